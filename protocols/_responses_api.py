"""The OpenAI Responses contract, its core: POST /v1/responses and its token count.

`input` is a string or typed Items: messages (user, assistant, system, developer) whose
content is a string or `input_text` / `output_text` parts. Every other field of the
reference is known by name: honoured, accepted without effect (docs/api.md says why
each is harmless), or refused with `unsupported_parameter` naming it (tools, hosted
tools, background jobs, reasoning on a model without a reasoning template, ...).
Unknown fields are refused with `unknown_parameter`. Errors use OpenAI's envelope.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._openai import (
    SCHEMA_NAME,
    TEXT_FORMATS,
    check_metadata,
    check_tool_choice,
    refuse_known,
)
from protocols._schema import check_limits, schema
from protocols._strict import (
    InvalidType,
    invalid_value,
    kind_name,
    make_converter,
    register_list,
    register_text_or_list,
    structure,
    unsupported,
)
from protocols._tools import check_tool_name, refuse_hosted_tools, replayed_arguments

__all__ = [
    "InputTokensRequest",
    "ResponsesCodec",
    "ResponsesInputItem",
    "ResponsesReasoning",
    "ResponsesRequest",
    "ResponsesTool",
]

_REFUSED = schema(refused=True)

# Item and content-part types of the reference that this server does not take.
_ITEM_TYPES = frozenset(
    {"item_reference",
     "file_search_call", "web_search_call", "computer_call", "computer_call_output",
     "image_generation_call", "code_interpreter_call", "local_shell_call",
     "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
     "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
     "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output",
     "compaction"}
)  # fmt: skip
_PART_TYPES = frozenset({"input_image", "input_file", "input_audio", "refusal"})
_ROLES = ("user", "assistant", "system", "developer")


@attrs.frozen
class ResponsesContentPart:
    """One part of a message's content: `input_text`, or `output_text` when an assistant
    turn is replayed."""

    type: str = attrs.field(metadata=schema(enum=["input_text", "output_text", "reasoning_text"]))
    text: str | None = None
    annotations: list[Any] | None = None  # of a replayed output_text: no effect
    logprobs: list[Any] | None = None  # likewise
    # Present only so that a part of another type is refused by its type, not by its fields.
    image_url: Any = attrs.field(default=None, metadata=_REFUSED)
    file_id: Any = attrs.field(default=None, metadata=_REFUSED)
    file_data: Any = attrs.field(default=None, metadata=_REFUSED)
    file_url: Any = attrs.field(default=None, metadata=_REFUSED)
    filename: Any = attrs.field(default=None, metadata=_REFUSED)
    detail: Any = attrs.field(default=None, metadata=_REFUSED)
    input_audio: Any = attrs.field(default=None, metadata=_REFUSED)
    refusal: Any = attrs.field(default=None, metadata=_REFUSED)


@attrs.frozen
class ResponsesInputItem:
    """One input Item: a message (`type` may be left out, as the SDKs' easy form does)."""

    role: str | None = attrs.field(default=None, metadata=schema(enum=list(_ROLES)))
    content: str | list[ResponsesContentPart] | None = None
    type: str | None = attrs.field(
        default=None,
        metadata=schema(enum=["message", "function_call", "function_call_output", "reasoning"]),
    )
    id: str | None = attrs.field(default=None, metadata=schema(minLength=1, maxLength=128))
    status: str | None = attrs.field(
        default=None, metadata=schema(enum=["in_progress", "completed", "incomplete"])
    )
    phase: Any = attrs.field(default=None, metadata=_REFUSED)
    # A function_call Item (a call the model made, replayed): call_id, name, arguments;
    # a function_call_output Item: call_id and output.
    call_id: str | None = attrs.field(default=None, metadata=schema(minLength=1, maxLength=128))
    name: str | None = None
    arguments: str | None = None  # JSON text of an object
    output: str | list[ResponsesContentPart] | None = None
    # A reasoning Item (a thinking model's, replayed): `content` of reasoning_text parts;
    # its summary is taken as sent (none is produced here), encrypted content refused.
    summary: list[Any] | None = None
    encrypted_content: Any = attrs.field(default=None, metadata=_REFUSED)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


@attrs.frozen
class ResponsesTool:
    """A function tool, flat as Responses writes it (hosted tools are refused)."""

    type: str = attrs.field(metadata=schema(enum=["function"]))
    name: str | None = attrs.field(default=None, metadata=schema(pattern="^[A-Za-z0-9_-]{1,64}$"))
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object
    strict: bool | None = None  # the schema is always enforced, strict or not


@attrs.frozen
class ResponsesTextFormat:
    """text, json_object, or json_schema (flat: name, schema, strict, description),
    enforced while decoding."""

    type: str = attrs.field(metadata=schema(enum=["text", "json_object", "json_schema"]))
    name: str | None = attrs.field(default=None, metadata=schema(pattern="^[A-Za-z0-9_-]{1,64}$"))
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class ResponsesTextConfig:
    format: ResponsesTextFormat | None = None
    verbosity: str | None = attrs.field(
        default=None, metadata=schema(enum=["low", "medium", "high"])
    )


@attrs.frozen
class ResponsesStreamOptions:
    include_obfuscation: bool | None = None  # accepted; no padding field is ever added


# The Responses API's reasoning efforts (none turns thinking off, any other on).
_EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max"]


@attrs.frozen
class ResponsesReasoning:
    effort: str | None = attrs.field(default=None, metadata=schema(enum=_EFFORTS))
    summary: str | None = None
    generate_summary: str | None = None


_SERVICE_TIERS = ["auto", "default", "flex", "scale", "priority", "fast"]
Input = str | list[ResponsesInputItem]


@attrs.frozen
class ResponsesRequest:
    """An OpenAI Responses request (POST /v1/responses)."""

    model: str
    input: Input
    instructions: str | None = None
    previous_response_id: str | None = attrs.field(
        default=None, metadata=schema(minLength=1, maxLength=128)
    )
    max_output_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=16))
    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=2))
    top_p: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0, maximum=1))
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = attrs.field(default=None, metadata=schema(default=True))
    metadata: dict[str, Any] | None = None
    text: ResponsesTextConfig | None = None
    service_tier: str | None = attrs.field(default=None, metadata=schema(enum=_SERVICE_TIERS))
    truncation: str | None = attrs.field(default=None, metadata=schema(enum=["auto", "disabled"]))
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None
    top_logprobs: int | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=20))
    background: bool | None = None
    include: list[str] | None = None
    reasoning: ResponsesReasoning | None = None
    # Accepted without effect (docs/api.md says why each is harmless).
    user: str | None = None
    safety_identifier: str | None = attrs.field(default=None, metadata=schema(maxLength=64))
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = attrs.field(
        default=None, metadata=schema(enum=["in_memory", "24h"])
    )
    prompt_cache_options: dict[str, Any] | None = None
    # Known, not supported here.
    conversation: Any = attrs.field(default=None, metadata=_REFUSED)
    context_management: Any = attrs.field(default=None, metadata=_REFUSED)
    prompt: Any = attrs.field(default=None, metadata=_REFUSED)
    max_tool_calls: Any = attrs.field(default=None, metadata=_REFUSED)
    moderation: Any = attrs.field(default=None, metadata=_REFUSED)
    image: Any = attrs.field(default=None, metadata=_REFUSED)
    access_programs: Any = attrs.field(default=None, metadata=_REFUSED)
    background_options: Any = attrs.field(default=None, metadata=_REFUSED)


@attrs.frozen
class InputTokensRequest:
    """A Responses token count (POST /v1/responses/input_tokens): the prompt
    /v1/responses would build, counted without generating."""

    model: str
    input: Input | None = None
    instructions: str | None = None
    previous_response_id: str | None = attrs.field(
        default=None, metadata=schema(minLength=1, maxLength=128)
    )
    text: ResponsesTextConfig | None = None
    truncation: str | None = attrs.field(default=None, metadata=schema(enum=["auto", "disabled"]))
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None
    reasoning: ResponsesReasoning | None = None
    conversation: Any = attrs.field(default=None, metadata=_REFUSED)
    personality: Any = attrs.field(default=None, metadata=_REFUSED)


_invalid, _unsupported = invalid_value, unsupported


class ResponsesCodec:
    """Strict parsing for the Responses routes; one converter per app, never global."""

    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, dict[str, Any])
        register_list(conv, ResponsesTool)
        conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)
        register_list(conv, str)
        register_text_or_list(conv, ResponsesContentPart, "content parts")
        register_text_or_list(conv, ResponsesInputItem, "Items")

        def tool_choice_hook(value: Any, _: type) -> str | dict[str, Any] | None:
            if value is None or isinstance(value, str | dict):
                return value
            raise InvalidType("string or object")

        conv.register_structure_hook_func(
            lambda t: t == (str | dict[str, Any] | None), tool_choice_hook
        )
        self._conv: cattrs.Converter = conv

    def parse_create(self, body: Any) -> ResponsesRequest:
        refuse_hosted_tools(body, ("function",))
        req = structure(self._conv, body, ResponsesRequest)
        refuse_known(req)
        _check_input(req.input, required=True)
        _check_features(req)
        if req.top_logprobs:
            raise _unsupported("top_logprobs", "top_logprobs is not supported here yet (only 0)")
        if req.background:
            raise _unsupported(
                "background", "background responses are not supported; omit it or send false"
            )
        if req.include:
            raise _unsupported(
                "include[0]", "include is not supported here; no extra output data is produced"
            )
        check_metadata(req.metadata)
        check_limits(req)
        return req

    def parse_input_tokens(self, body: Any) -> InputTokensRequest:
        refuse_hosted_tools(body, ("function",))
        req = structure(self._conv, body, InputTokensRequest)
        refuse_known(req)
        _check_input(req.input, required=False)
        _check_features(req)
        check_limits(req)
        return req


def _check_text_format(fmt: ResponsesTextFormat) -> None:
    if fmt.type not in TEXT_FORMATS:
        raise invalid_value(
            "text.format.type",
            f"text.format {kind_name(fmt.type, TEXT_FORMATS)} is not a type; one of 'text', "
            "'json_object', 'json_schema'",
        )
    schema_fields = (fmt.name, fmt.schema, fmt.strict, fmt.description)
    if fmt.type != "json_schema" and any(f is not None for f in schema_fields):
        raise invalid_value(
            "text.format", "name, schema, strict and description go with json_schema"
        )
    if fmt.type == "json_schema" and (fmt.name is None or not SCHEMA_NAME.match(fmt.name)):
        raise invalid_value(
            "text.format.name",
            "a json_schema format needs a name: 1 to 64 of a-z, A-Z, 0-9, _ and -",
        )


def _check_features(req: ResponsesRequest | InputTokensRequest) -> None:
    """What both routes check alike: function tools only and the tool choice, the text
    format, reasoning (refused), dropping Items to fit (refused)."""
    names: list[str] = []
    for i, tool in enumerate(req.tools or ()):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise _unsupported(f"{where}.type", "only function tools are supported")
        if tool.name is None:
            raise _invalid(f"{where}.name", f"{where} needs its name", "missing_required_parameter")
        if tool.name in names:
            raise _invalid(f"{where}.name", "two tools have the same name")
        names.append(tool.name)
    check_tool_choice(req.tool_choice, names, function_key=False)
    fmt = req.text.format if req.text else None
    if fmt is not None:
        _check_text_format(fmt)
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and effort not in _EFFORTS:
        raise _invalid("reasoning.effort", f"reasoning.effort must be one of {', '.join(_EFFORTS)}")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        raise _unsupported("reasoning.summary", "reasoning summaries are not produced here")
    if req.truncation == "auto":
        raise _unsupported(
            "truncation",
            "truncation auto (dropping Items to fit) is not supported; an input that does not "
            "fit the context is refused instead",
        )


def _check_input(value: Input | None, *, required: bool) -> None:
    if value is None:
        if required:
            raise _invalid("input", "input is required", code="missing_required_parameter")
        return
    if isinstance(value, str):
        return
    if not value:
        raise _invalid("input", "input must hold at least one Item")
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if item.type is not None and item.type not in _TAKEN:
            raise _unsupported(
                f"{where}.type",
                f"Items of {kind_name(item.type, _ITEM_TYPES)} are not supported; only "
                "message, function_call and function_call_output Items are",
            )
        refuse_known(item, where)  # a field of another Item type
        if item.id is not None:
            if item.id in seen:
                raise _invalid(f"{where}.id", f"{where}.id repeats an earlier Item's id")
            seen.add(item.id)
        if item.type in ("function_call", "function_call_output"):
            _check_call_item(item, where)
            continue
        if item.type == "reasoning":
            _check_reasoning_item(item, where)
            continue
        if item.summary is not None:
            raise _invalid(f"{where}.summary", "a message Item has no summary",
                           "unknown_parameter")  # fmt: skip
        for name in ("call_id", "name", "arguments", "output"):
            if getattr(item, name) is not None:
                raise _invalid(f"{where}.{name}", f"a message Item has no {name}",
                               "unknown_parameter")  # fmt: skip
        if item.role is None:
            raise _invalid(f"{where}.role", f"{where} needs its role", "missing_required_parameter")
        if item.role not in _ROLES:  # never rendered raw into the chat template
            raise _invalid(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}")
        if item.content is None:
            raise _invalid(
                f"{where}.content", f"{where} needs its content", "missing_required_parameter"
            )
        if isinstance(item.content, list):
            for j, part in enumerate(item.content):
                at = f"{where}.content[{j}]"
                if part.type not in ("input_text", "output_text"):
                    raise _unsupported(
                        f"{at}.type",
                        f"content parts of {kind_name(part.type, _PART_TYPES)} are not "
                        "supported; only input_text and output_text are",
                    )
                refuse_known(part, at)
                if part.type == "output_text" and item.role != "assistant":
                    raise _invalid(f"{at}.type", "output_text parts belong to assistant Items")
                if part.text is None:
                    raise _invalid(
                        f"{at}.text", f"{at} needs its text", "missing_required_parameter"
                    )


_TAKEN = ("message", "function_call", "function_call_output", "reasoning")


def _check_reasoning_item(item: ResponsesInputItem, where: str) -> None:
    """A reasoning Item: its summary (a list), and content of reasoning_text parts."""
    for name in ("role", "call_id", "name", "arguments", "output"):
        if getattr(item, name) is not None:
            raise _invalid(f"{where}.{name}", f"a reasoning Item has no {name}",
                           "unknown_parameter")  # fmt: skip
    if item.summary is None:
        raise _invalid(f"{where}.summary", f"{where} needs its summary",
                       "missing_required_parameter")  # fmt: skip
    if isinstance(item.content, str):
        raise _invalid(f"{where}.content", "a reasoning Item's content is reasoning_text parts")
    for j, part in enumerate(item.content or ()):
        if part.type != "reasoning_text" or part.text is None:
            raise _invalid(
                f"{where}.content[{j}]", "a reasoning Item's content is reasoning_text parts"
            )


def _check_call_item(item: ResponsesInputItem, where: str) -> None:
    """A function_call Item: call_id, name and arguments; a function_call_output Item:
    call_id and output (text). Neither has a role or content."""
    for name in ("role", "content"):
        if getattr(item, name) is not None:
            raise _invalid(f"{where}.{name}", f"a {item.type} Item has no {name}",
                           "unknown_parameter")  # fmt: skip
    own = ("call_id", "name", "arguments") if item.type == "function_call" else (
        "call_id", "output")  # fmt: skip
    for name in ("name", "arguments", "output"):
        if name not in own and getattr(item, name) is not None:
            raise _invalid(f"{where}.{name}", f"a {item.type} Item has no {name}",
                           "unknown_parameter")  # fmt: skip
    for name in own:
        if getattr(item, name) is None:
            raise _invalid(f"{where}.{name}", f"{where} needs its {name}",
                           "missing_required_parameter")  # fmt: skip
    if item.type == "function_call":
        check_tool_name(item.name, f"{where}.name")
        assert item.arguments is not None
        replayed_arguments(item.arguments, f"{where}.arguments")
    elif isinstance(item.output, list):
        for j, part in enumerate(item.output):
            if part.type != "input_text" or part.text is None:
                raise _unsupported(
                    f"{where}.output[{j}]", "a function_call_output's parts are input_text only"
                )
