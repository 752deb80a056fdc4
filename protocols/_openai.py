"""The OpenAI-compatible contract: /v1/chat/completions, /v1/completions, /v1/models.

Every field the OpenAI clients send is honoured, refused by name, or (where
harmless, and listed in docs/api.md) accepted without effect. Unknown fields are
refused with code `unknown_parameter`. Errors use OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import cattrs

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
from protocols._tools import check_tool_name, replayed_arguments

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "OpenAICodec",
    "logit_bias_pairs",
]


@attrs.frozen
class TextPart:
    type: str = attrs.field(metadata=schema(enum=["text"]))
    text: str | None = None
    # Present only so that a part of another type is refused by its type, not by its fields.
    image_url: dict[str, Any] | None = attrs.field(default=None, metadata=schema(refused=True))
    input_audio: dict[str, Any] | None = attrs.field(default=None, metadata=schema(refused=True))
    file: dict[str, Any] | None = attrs.field(default=None, metadata=schema(refused=True))
    refusal: str | None = attrs.field(default=None, metadata=schema(refused=True))


@attrs.frozen
class CalledFunction:
    name: str
    arguments: str  # JSON text of an object


@attrs.frozen
class MessageToolCall:
    """A call an assistant message made, replayed in the history."""

    id: str
    type: str = attrs.field(metadata=schema(enum=["function"]))
    function: CalledFunction | None = None
    custom: dict[str, Any] | None = attrs.field(default=None, metadata=schema(refused=True))


@attrs.frozen
class FunctionDefinition:
    name: str = attrs.field(metadata=schema(pattern="^[A-Za-z0-9_-]{1,64}$"))
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object
    strict: bool | None = None  # the schema is always enforced, strict or not


@attrs.frozen
class ChatTool:
    type: str = attrs.field(metadata=schema(enum=["function"]))
    function: FunctionDefinition | None = None
    custom: dict[str, Any] | None = attrs.field(default=None, metadata=schema(refused=True))


@attrs.frozen
class ChatMessage:
    role: str = attrs.field(
        metadata=schema(enum=["system", "developer", "user", "assistant", "tool"])
    )
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # of an assistant message
    # An assistant message's reasoning, as the answer gave it (vLLM's field): the chat
    # template decides whether it is kept in the prompt.
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


@attrs.frozen
class StreamOptions:
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no padding field is ever added


@attrs.frozen
class ResponseFormat:
    """text, json_object (any JSON object) or json_schema (the output matches the
    schema: {name, description?, schema?, strict?}), enforced while decoding."""

    type: str
    json_schema: dict[str, Any] | None = None
    # llama-server's shape: the schema itself beside json_object or json_schema
    schema: Any = None


# Fields of the OpenAI references that this server knows and cannot honour: parsed only
# to be refused by name (unsupported_parameter), never as unknown.
_REFUSED = schema(refused=True)
_SERVICE_TIERS = ["auto", "default", "flex", "scale", "priority", "fast"]
_EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh"]
TEMPLATE_SWITCHES = ("enable_thinking", "preserve_thinking")  # chat_template_kwargs
LOGIT_BIAS_MAX = 1024  # entries; OpenAI documents no count, only -100..100 per entry
METADATA_MAX_PAIRS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512


@attrs.frozen
class _Sampling:
    """Fields the chat and text completion requests share."""

    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=2))
    top_p: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0, maximum=1))
    top_k: int | None = attrs.field(default=None, metadata=schema(minimum=0))
    min_p: float | None = attrs.field(default=None, metadata=schema(minimum=0, exclusiveMaximum=1))
    presence_penalty: float | None = attrs.field(
        default=None, metadata=schema(minimum=-2, maximum=2)
    )
    frequency_penalty: float | None = attrs.field(
        default=None, metadata=schema(minimum=-2, maximum=2)
    )
    seed: int | None = attrs.field(
        default=None, metadata=schema(minimum=-(2**63), maximum=2**63 - 1)
    )
    stop: str | list[str] | None = attrs.field(
        default=None, metadata=schema(minLength=1, maxItems=4, items={"minLength": 1})
    )
    # One choice per sequence, decoded together (at most --max-concurrency in all).
    n: int | None = attrs.field(default=None, metadata=schema(minimum=1, maximum=128))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Token id (as a string) -> bias added to its logit, -100..100.
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    # llama-server's own fields (docs/api.md, "From llama-server"): its output budget
    # (-1: as many tokens as the context and the KV pool leave room for), its repetition
    # penalty over the last repeat_last_n output tokens (-1: all), the sampler stages to
    # run in order; the rest accepted without effect (progress, per-token timings, SSE
    # pings, caching, where sampling runs: docs/api.md says what each would change).
    n_predict: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    repeat_penalty: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0))
    repeat_last_n: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    samplers: list[str] | None = None
    return_progress: bool | None = None
    timings_per_token: bool | None = None
    sse_ping_interval: float | None = attrs.field(default=None, metadata=schema(minimum=0))
    cache_prompt: bool | None = None
    backend_sampling: bool | None = None

    def requested_tokens(self, *fields: str) -> tuple[int | None, str]:
        """The output budget asked for and the field it came in: the first of `fields`
        set, else n_predict; None for none, or for -1 (up to the room left)."""
        for name in (*fields, "n_predict"):
            value = getattr(self, name)
            if value is not None:
                return (None if value == -1 else value), name
        return None, fields[-1]


@attrs.frozen
class ChatRequest(_Sampling):
    """An OpenAI chat completion request (POST /v1/chat/completions)."""

    # Left out or null: the served model (llama-server's and vLLM's rule; its web UI
    # sends none).
    model: str | None = attrs.field(default=None, kw_only=True)
    messages: list[ChatMessage] = attrs.field(kw_only=True, metadata=schema(minItems=1))
    max_completion_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1))
    # -1: as many as the context and the pool leave room for (llama-server's)
    max_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    logprobs: bool | None = None
    # 0..20, checked by the codec (the published contract has declared no limit since
    # the field was refused whole).
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted without effect (docs/api.md says why each is harmless).
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = attrs.field(
        default=None, metadata=schema(enum=["in_memory", "24h"])
    )
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = attrs.field(default=None, metadata=schema(maxLength=64))
    service_tier: str | None = attrs.field(default=None, metadata=schema(enum=_SERVICE_TIERS))
    modalities: list[str] | None = None  # ["text"] only
    # Known, not supported here.
    audio: Any = attrs.field(default=None, metadata=_REFUSED)
    functions: Any = attrs.field(default=None, metadata=_REFUSED)
    function_call: Any = attrs.field(default=None, metadata=_REFUSED)
    moderation: Any = attrs.field(default=None, metadata=_REFUSED)
    prediction: Any = attrs.field(default=None, metadata=_REFUSED)
    # Thinking, on a model whose chat template can (docs/api.md, "Thinking"): none turns
    # it off, any other effort on (the models served here have no effort levels).
    reasoning_effort: str | None = attrs.field(default=None, metadata=schema(enum=_EFFORTS))
    # Template variables, as vLLM takes them: enable_thinking and preserve_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server's web UI's: where the reasoning goes (auto and deepseek: in
    # reasoning_content, as ninfer always puts it), and its reasoning control (accepted
    # without effect: there is no endpoint to end reasoning early here).
    reasoning_format: str | None = attrs.field(
        default=None, metadata=schema(enum=["auto", "deepseek", "deepseek-legacy", "none"])
    )
    reasoning_control: bool | None = None
    # llama-server's structured output beside response_format: a JSON schema the answer
    # matches (as response_format's json_object with schema), and GBNF grammars (refused:
    # ninfer's grammars are JSON schemas and tools)
    json_schema: dict[str, Any] | None = None
    grammar: Any = attrs.field(default=None, metadata=_REFUSED)
    # Its reasoning budget (sent with an effort): no effect, as Anthropic's budget_tokens
    # here: the reasoning counts toward the output budget and is not cut apart from it.
    thinking_budget_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    verbosity: Any = attrs.field(default=None, metadata=_REFUSED)
    web_search_options: Any = attrs.field(default=None, metadata=_REFUSED)


# A text completion's prompt: a string, strings, token ids, or lists of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


@attrs.frozen
class CompletionRequest(_Sampling):
    """An OpenAI text completion request (POST /v1/completions)."""

    model: str | None = attrs.field(default=None, kw_only=True)  # None: the served model
    prompt: Prompt = attrs.field(kw_only=True)
    max_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=-1, default=16))
    echo: bool | None = None
    # 0..5; best_of only 1; suffix refused: checked by the codec (the published contract
    # has declared no limits since these fields were refused whole).
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


_PART_TYPES = frozenset({"image_url", "input_audio", "file", "refusal"})
_FORMATS = frozenset({"json_object", "json_schema"})
TEXT_FORMATS = frozenset({"text", *_FORMATS})  # response_format's and text.format's types


_invalid, _unsupported = invalid_value, unsupported
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a json_schema format's name
_JSON_SCHEMA_KEYS = {"name": str, "description": str, "schema": dict, "strict": bool}


def _check_llama_fields(req: _Sampling, *budgets: str) -> None:
    """llama-server's budget values: -1 or at least 1 (0, llama-server's "evaluate the
    prompt only", is refused), and n_predict agreeing with the OpenAI field beside it."""
    for name in (*budgets, "n_predict"):
        if getattr(req, name, None) == 0:
            raise _invalid(
                name,
                f"{name} must be at least 1, or -1 (as many tokens as the context and the "
                "KV pool leave room for)",
            )
    given = [v for name in budgets if (v := getattr(req, name)) is not None]
    if req.n_predict is not None and given and given[0] != req.n_predict:
        raise _invalid("n_predict", f"n_predict and {budgets[0]} disagree; send one of them")
    if req.samplers is not None and len(req.samplers) > SAMPLERS_MAX:
        raise _invalid("samplers", f"samplers takes at most {SAMPLERS_MAX} names")


SAMPLERS_MAX = 16  # llama-server knows 11 names; an order names each once


def _check_response_format(fmt: ResponseFormat) -> None:
    """OpenAI's response_format: its type, and json_schema's own fields (the schema
    itself is compiled by the server, which names what it cannot enforce)."""
    if fmt.type not in TEXT_FORMATS:
        raise _invalid(
            "response_format.type",
            f"response_format {kind_name(fmt.type, _FORMATS)} is not a type; "
            "one of 'text', 'json_object', 'json_schema'",
        )
    if fmt.schema is not None:  # llama-server's: {"type": json_object|json_schema, "schema"}
        if fmt.type == "text" or fmt.json_schema is not None:
            raise _invalid(
                "response_format.schema",
                "schema goes with type json_object or json_schema, once (not also in "
                "json_schema.schema)",
            )
        if not isinstance(fmt.schema, dict):
            raise _invalid("response_format.schema", "response_format.schema must be an object")
        return
    if fmt.type != "json_schema":
        if fmt.json_schema is not None:
            raise _invalid("response_format.json_schema", "json_schema goes with type json_schema")
        return
    spec = fmt.json_schema
    if spec is None:
        raise _invalid("response_format.json_schema", "type json_schema needs json_schema")
    for key, value in spec.items():
        where = f"response_format.json_schema.{key}" if SCHEMA_NAME.match(key) else (
            "response_format.json_schema")  # fmt: skip
        kind = _JSON_SCHEMA_KEYS.get(key)
        if kind is None:
            raise _invalid(where, "unknown field of json_schema", code="unknown_parameter")
        if value is not None and not isinstance(value, kind):
            raise _invalid(where, f"must be of type {kind.__name__}")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise _invalid(
            "response_format.json_schema.name",
            "json_schema.name is required: 1 to 64 of a-z, A-Z, 0-9, _ and -",
        )


def _check_thinking(req: ChatRequest) -> None:
    """reasoning_effort (one of the efforts), chat_template_kwargs (only the thinking
    switches, as booleans, agreeing with reasoning_effort), and reasoning_content on
    assistant messages only."""
    if req.reasoning_effort is not None and req.reasoning_effort not in _EFFORTS:
        raise _invalid("reasoning_effort", f"reasoning_effort must be one of {', '.join(_EFFORTS)}")
    for key, value in (req.chat_template_kwargs or {}).items():
        where = f"chat_template_kwargs.{key}" if SCHEMA_NAME.match(key) else (
            "chat_template_kwargs")  # fmt: skip
        if key not in TEMPLATE_SWITCHES:
            raise _unsupported(
                where, "chat_template_kwargs takes only enable_thinking and preserve_thinking"
            )
        if not isinstance(value, bool):
            raise _invalid(where, f"{where} must be true or false", code="invalid_type")
    switch = (req.chat_template_kwargs or {}).get("enable_thinking")
    effort = req.reasoning_effort
    if switch is not None and effort is not None and switch != (effort != "none"):
        raise _invalid(
            "chat_template_kwargs.enable_thinking",
            "chat_template_kwargs.enable_thinking and reasoning_effort disagree",
        )
    for i, m in enumerate(req.messages):
        if m.reasoning_content is not None and m.role != "assistant":
            raise _invalid(
                f"messages[{i}].reasoning_content", "only an assistant message has reasoning"
            )


def _check_replayed_calls(m: ChatMessage, where: str) -> None:
    if m.role != "assistant":
        raise _invalid(f"{where}.tool_calls", "only an assistant message has tool_calls")
    for j, call in enumerate(m.tool_calls or ()):
        at = f"{where}.tool_calls[{j}]"
        refuse_known(call, at)
        if call.function is None:
            raise _invalid(f"{at}.function", f"{at} needs its function",
                           code="missing_required_parameter")  # fmt: skip
        check_tool_name(call.function.name, f"{at}.function.name")
        replayed_arguments(call.function.arguments, f"{at}.function.arguments")


def _check_tools(req: ChatRequest) -> None:
    """tools (functions only), tool_choice (none, auto, required or a named function of
    tools) and the functions' names, unique."""
    names: list[str] = []
    for i, tool in enumerate(req.tools or ()):
        where = f"tools[{i}]"
        refuse_known(tool, where)
        if tool.type != "function":
            raise _unsupported(f"{where}.type", "only function tools are supported")
        if tool.function is None:
            raise _invalid(f"{where}.function", f"{where} needs its function",
                           code="missing_required_parameter")  # fmt: skip
        name = check_tool_name(tool.function.name, f"{where}.function.name")
        if name in names:
            raise _invalid(f"{where}.function.name", "two tools have the same name")
        names.append(name)
    check_tool_choice(req.tool_choice, names, function_key=True)


def check_tool_choice(choice: str | dict[str, Any] | None, names: list[str], *,
                      function_key: bool) -> None:  # fmt: skip
    """OpenAI's tool_choice: none, auto, required, or a function of `names` (chat:
    {"type": "function", "function": {"name"}}; Responses: {"type": "function", "name"})."""
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _invalid("tool_choice", "tool_choice must be none, auto, required or a function")
        if choice != "none" and not names:
            raise _invalid("tool_choice", "tool_choice needs tools to choose from")
        return
    if choice.get("type") != "function":
        raise _unsupported(
            "tool_choice.type", "tool_choice may name a function; other choices are not supported"
        )
    inner: Any = choice.get("function") if function_key else choice
    keys = {"type", "function"} if function_key else {"type", "name"}
    if not isinstance(inner, dict) or set(choice) - keys or set(inner) - {"name", "type"}:
        raise _invalid("tool_choice", "tool_choice names a function by its name only")
    name = inner.get("name")
    where = "tool_choice.function.name" if function_key else "tool_choice.name"
    if not isinstance(name, str) or name not in names:
        raise _invalid(where, "tool_choice names a function that is not among the tools")


class OpenAICodec:
    """Strict parsing for the OpenAI routes; one converter per app, never global."""

    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, str)
        register_list(conv, int)
        register_list(conv, list[int])
        register_list(conv, TextPart)
        register_list(conv, ChatMessage)
        register_list(conv, MessageToolCall)
        register_list(conv, ChatTool)
        register_list(conv, dict[str, Any])

        def tool_choice_hook(value: Any, _: type) -> str | dict[str, Any] | None:
            if value is None or isinstance(value, str | dict):
                return value
            raise InvalidType("string or object")

        def prompt_hook(value: Any, _: type) -> Prompt:
            if isinstance(value, str):
                return value
            if isinstance(value, list) and value:
                if all(isinstance(x, str) for x in value):
                    return conv.structure(value, list[str])
                if all(isinstance(x, list) for x in value):
                    return conv.structure(value, list[list[int]])
                return conv.structure(value, list[int])
            raise InvalidType(
                "string, array of strings, array of token ids or array of arrays of token ids"
            )

        def any_hook(value: Any, _: type) -> Any:
            return value

        register_text_or_list(conv, TextPart, "content parts")
        register_text_or_list(conv, str, "strings")
        conv.register_structure_hook_func(
            lambda t: t == (str | dict[str, Any] | None), tool_choice_hook
        )
        conv.register_structure_hook_func(lambda t: t == Prompt, prompt_hook)
        conv.register_structure_hook_func(lambda t: t is Any, any_hook)
        self._conv: cattrs.Converter = conv

    def parse_chat(self, body: Any) -> ChatRequest:
        req = structure(self._conv, body, ChatRequest)
        refuse_known(req)
        if not req.messages:
            raise _invalid("messages", "messages must contain at least one message")
        calls_made: set[str] = set()  # the ids of the calls replayed so far
        for i, m in enumerate(req.messages):
            where = f"messages[{i}]"
            if m.role not in ("system", "developer", "user", "assistant", "tool"):
                raise _invalid(
                    f"{where}.role",
                    f"{where}.role must be one of system, developer, user, assistant, tool",
                )
            if m.role == "tool" and not m.tool_call_id:
                raise _invalid(
                    f"{where}.tool_call_id",
                    f"{where} has role tool and needs its tool_call_id",
                    code="missing_required_parameter",
                )
            if m.role == "tool" and m.tool_call_id not in calls_made:
                raise _invalid(
                    f"{where}.tool_call_id",
                    f"{where} answers a tool call that no assistant message before it made",
                )
            if m.content is None and m.role != "assistant":
                raise _invalid(f"{where}.content", f"{where}.content is required")
            if m.tool_calls is not None:
                _check_replayed_calls(m, where)
                calls_made.update(c.id for c in m.tool_calls)
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise _invalid(
                            f"{where}.content[{j}].type",
                            f"content parts of {kind_name(part.type, _PART_TYPES)} are not "
                            "supported; "
                            "only text parts are",
                        )
                    if part.text is None:
                        raise _invalid(
                            f"{where}.content[{j}].text",
                            f"missing required parameter: {where}.content[{j}].text",
                            code="missing_required_parameter",
                        )
        _check_tools(req)
        _check_thinking(req)
        if (
            req.max_tokens is not None
            and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens
        ):
            raise _invalid(
                "max_tokens",
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
            )
        if req.reasoning_format not in (None, "auto", "deepseek"):
            raise _unsupported(
                "reasoning_format",
                "reasoning_format must be auto or deepseek here: the reasoning is always "
                "in reasoning_content",
            )
        _check_llama_fields(req, "max_tokens", "max_completion_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise _invalid("top_logprobs", "top_logprobs needs logprobs set to true")
        _check_range("top_logprobs", req.top_logprobs, 0, 20)
        if req.response_format is not None:
            _check_response_format(req.response_format)
            if req.json_schema is not None:
                raise _invalid("json_schema", "json_schema and response_format: send one")
        for i, modality in enumerate(req.modalities or ()):
            if modality != "text":
                raise _unsupported(f"modalities[{i}]", "only the text modality is supported")
        check_metadata(req.metadata)
        check_limits(req)
        return req

    def parse_completion(self, body: Any) -> CompletionRequest:
        req = structure(self._conv, body, CompletionRequest)
        refuse_known(req)
        if req.suffix is not None:
            raise _unsupported("suffix", "suffix is not supported by this server")
        if req.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of is not supported by this server (only 1)")
        _check_range("logprobs", req.logprobs, 0, 5)
        _check_llama_fields(req, "max_tokens")
        # Refused since v0.1 but never declared as minLength in the published contract:
        # declaring it now would read as a tightened limit to `ninfer openapi --compare`.
        for i, prompt in enumerate(req.prompts()):
            where = "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]"
            if not prompt:
                raise _invalid(where, f"{where} must not be empty")
            if isinstance(prompt, list) and any(t < 0 for t in prompt):
                raise _invalid(where, f"{where} holds a negative token id")
        check_limits(req)
        return req


def refuse_known(req: Any, where: str = "") -> None:
    """Refuse, by name (under `where`, for a nested object), the first field of the
    reference this server cannot honour."""
    for field in attrs.fields(type(req)):
        if field.metadata.get("schema", {}).get("refused") and getattr(req, field.name) is not None:
            name = f"{where}.{field.name}" if where else field.name
            raise _unsupported(name, f"{name} is not supported by this server")


def _check_range(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise _invalid(name, f"{name} must be at least {low} and at most {high}")


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return
    if len(metadata) > METADATA_MAX_PAIRS:
        raise _invalid("metadata", f"metadata takes at most {METADATA_MAX_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_MAX:
            raise _invalid("metadata", f"metadata keys are at most {METADATA_KEY_MAX} characters")
        if not isinstance(value, str):
            raise _invalid("metadata", "metadata values must be strings", code="invalid_type")
        if len(value) > METADATA_VALUE_MAX:
            raise _invalid(
                "metadata", f"metadata values are at most {METADATA_VALUE_MAX} characters"
            )


def logit_bias_pairs(bias: dict[str, Any] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token id as a string -> -100..100) as (id, bias) pairs."""
    if not bias:
        return ()
    if len(bias) > LOGIT_BIAS_MAX:
        raise _invalid("logit_bias", f"logit_bias takes at most {LOGIT_BIAS_MAX} entries")
    pairs = []
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or int(key) >= vocab_size:
            raise _invalid(
                "logit_bias", f"logit_bias keys are token ids, 0 to {vocab_size - 1}, as strings"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _invalid("logit_bias", "logit_bias values are numbers", code="invalid_type")
        if not -100 <= value <= 100:
            raise _invalid("logit_bias", "logit_bias values must be between -100 and 100")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))
