"""The Anthropic-compatible contract: POST /v1/messages and /v1/messages/count_tokens.

Text and tools: `tools` (client functions), `tool_choice`, `tool_use` blocks of
assistant turns and `tool_result` blocks of user turns; `thinking` and the thinking
blocks of assistant turns (the server refuses them for a model that cannot think);
image, document, redacted_thinking and server-tool blocks are refused by name. The
`model` field names a served model (the server checks it).
Errors: `{"type": "error", "error": {"type", "message"}, "request_id"}`.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._openai import refuse_known
from protocols._schema import check_limits, schema
from protocols._strict import (
    invalid_value,
    kind_name,
    make_converter,
    register_list,
    register_text_or_list,
    structure,
)
from protocols._tools import check_tool_name, refuse_hosted_tools

__all__ = [
    "AnthropicCodec",
    "AnthropicMessage",
    "AnthropicThinking",
    "AnthropicTool",
    "AnthropicToolChoice",
    "CountTokensRequest",
    "MessagesRequest",
]


_BLOCK_TYPES = frozenset(
    {"image", "document", "thinking", "redacted_thinking",
     "search_result", "server_tool_use", "web_search_tool_result", "container_upload"}
)  # fmt: skip
_TOOL_CHOICES = ("auto", "any", "tool", "none")


_REFUSED = schema(refused=True)


@attrs.frozen
class ResultBlock:
    """A block of a tool_result's content (text only; others are refused by their type,
    as top-level blocks are)."""

    type: str = attrs.field(metadata=schema(enum=["text"]))
    text: str | None = None
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None
    # Present only so that an image or document block is refused by its type, not by
    # its fields.
    source: dict[str, Any] | None = attrs.field(default=None, metadata=_REFUSED)


@attrs.frozen
class Block:
    type: str = attrs.field(metadata=schema(enum=["text", "tool_use", "tool_result", "thinking"]))
    text: str | None = None  # of a text block
    id: str | None = None  # of a tool_use block (with name and input)
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # of a tool_result block (with content and is_error)
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    # A tool_use block the SDK hands back as it got it: who called (direct, the model)
    # is accepted; a toolset's call is refused.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = attrs.field(default=None, metadata=_REFUSED)
    # Present only so that another block is refused by its type, not by its fields.
    source: dict[str, Any] | None = attrs.field(default=None, metadata=_REFUSED)
    thinking: str | None = None  # of a thinking block (with its signature)
    signature: str | None = None
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None  # on text a client sends back: no effect

    def result_text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text or "" for b in self.content)


@attrs.frozen
class AnthropicTool:
    """A client tool: a function the model may call (server tools are refused)."""

    name: str = attrs.field(metadata=schema(pattern="^[A-Za-z0-9_-]{1,64}$"))
    input_schema: dict[str, Any] | None = None  # a JSON Schema of an object
    description: str | None = None
    type: str | None = attrs.field(default=None, metadata=schema(enum=["custom"]))
    cache_control: dict[str, Any] | None = None  # no effect: caching is automatic here
    # The rest of the SDK's ToolParam. `strict` holds by construction (a call's input is
    # decoded under its schema's grammar, strict or not); eager_input_streaming has no
    # effect (a call's input streams as it is decoded); input_examples are not shown to
    # the model; defer_loading (tool search) and callers other than "direct" (code
    # execution) are refused where they would change what the model may call.
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None


@attrs.frozen
class ToolChoice:
    type: str = attrs.field(metadata=schema(enum=list(_TOOL_CHOICES)))
    name: str | None = None  # of type tool
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class Message:
    role: str = attrs.field(metadata=schema(enum=["user", "assistant"]))
    content: str | list[Block]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text or "" for b in self.content if b.type == "text")

    def reasoning(self) -> str | None:
        """The reasoning of an assistant turn's thinking blocks (None: it has none)."""
        if isinstance(self.content, str):
            return None
        parts = [b.thinking or "" for b in self.content if b.type == "thinking"]
        return "\n\n".join(parts) if parts else None


@attrs.frozen
class ThinkingConfig:
    """`thinking`: enabled (with its budget of tokens, which counts toward max_tokens),
    adaptive (enabled; the model decides how much) or disabled."""

    type: str = attrs.field(metadata=schema(enum=["enabled", "adaptive", "disabled"]))
    budget_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1024))
    display: str | None = None  # the reasoning is always shown in full here

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


@attrs.frozen
class Metadata:
    user_id: str | None = None


def _system_text(system: str | list[Block] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "".join(b.text or "" for b in system)


@attrs.frozen
class MessagesRequest:
    """An Anthropic Messages request (POST /v1/messages)."""

    model: str
    max_tokens: int = attrs.field(metadata=schema(minimum=1))
    messages: list[Message] = attrs.field(metadata=schema(minItems=1))
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = attrs.field(
        default=None, metadata=schema(maxItems=4, items={"minLength": 1})
    )
    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=1))
    top_p: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0, maximum=1))
    top_k: int | None = attrs.field(default=None, metadata=schema(minimum=0))
    metadata: Metadata | None = None
    stream: bool | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Accepted without effect: caching is automatic here, one tier and place serve all.
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = attrs.field(
        default=None, metadata=schema(enum=["auto", "standard_only"])
    )
    inference_geo: str | None = None
    # Known, not supported here.
    container: Any = attrs.field(default=None, metadata=_REFUSED)
    mcp_servers: Any = attrs.field(default=None, metadata=_REFUSED)
    output_config: Any = attrs.field(default=None, metadata=_REFUSED)
    speed: Any = attrs.field(default=None, metadata=_REFUSED)
    diagnostics: Any = attrs.field(default=None, metadata=_REFUSED)
    context_management: Any = attrs.field(default=None, metadata=_REFUSED)
    # Message threads (a beta the SDKs' tool runners use): refused with the code on which
    # those runners send the turn again, whole, without it (no conversation is kept here).
    thread: Any = attrs.field(default=None, metadata=_REFUSED)

    def system_text(self) -> str | None:
        return _system_text(self.system)

    def unsupported(self) -> dict[str, Any]:
        """The fields refused by name when sent."""
        names = ("container", "mcp_servers",
                 "output_config", "speed", "diagnostics", "context_management")  # fmt: skip
        return {name: getattr(self, name) for name in names}


@attrs.frozen
class CountTokensRequest:
    """An Anthropic token-count request (POST /v1/messages/count_tokens)."""

    model: str
    messages: list[Message] = attrs.field(metadata=schema(minItems=1))
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def system_text(self) -> str | None:
        return _system_text(self.system)


_invalid = invalid_value


def _check_thinking(thinking: ThinkingConfig | None, max_tokens: int | None) -> None:
    """Anthropic's rules: enabled needs budget_tokens (at least 1024, below max_tokens);
    the others take none."""
    if thinking is None:
        return
    if thinking.type not in ("enabled", "adaptive", "disabled"):
        raise _invalid("thinking.type", "thinking.type must be enabled, adaptive or disabled")
    if thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise _invalid("thinking.budget_tokens", "thinking of type enabled needs budget_tokens",
                           code="missing_required_parameter")  # fmt: skip
        if thinking.budget_tokens < 1024:
            raise _invalid("thinking.budget_tokens", "thinking.budget_tokens must be at least 1024")
        if max_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise _invalid(
                "thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens"
            )
    elif thinking.budget_tokens is not None:
        raise _invalid("thinking.budget_tokens",
                       f"thinking of type {thinking.type} takes no budget_tokens")  # fmt: skip
    if thinking.display not in (None, "summarized", "omitted", "full"):
        raise _invalid("thinking.display", "thinking.display must be summarized or omitted")


class AnthropicCodec:
    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, str)
        register_list(conv, Message)
        register_list(conv, AnthropicTool)
        register_text_or_list(conv, ResultBlock, "content blocks")
        register_list(conv, dict[str, Any])
        conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)
        register_text_or_list(conv, Block, "content blocks")
        self._conv: cattrs.Converter = conv

    def _check_conversation(
        self, messages: list[Message], system: str | list[Block] | None, refused: dict[str, Any]
    ) -> None:
        for name, value in refused.items():
            if value is not None:
                raise ApiError(
                    "invalid_request",
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        if not messages:
            raise _invalid("messages", "messages must contain at least one message")
        calls_made: set[str] = set()  # the ids of the tool_use blocks so far
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            expected = "user" if i % 2 == 0 else "assistant"
            if m.role not in ("user", "assistant"):
                raise _invalid(f"{where}.role", f"{where}.role must be user or assistant")
            if m.role != expected:
                raise _invalid(
                    f"{where}.role",
                    "messages must alternate between user and assistant, starting with user",
                )
            if isinstance(m.content, list):
                self._check_blocks(m.content, f"{where}.content", m.role)
                for j, b in enumerate(m.content):
                    if b.type == "tool_use" and b.id is not None:
                        calls_made.add(b.id)
                    elif b.type == "tool_result" and b.tool_use_id not in calls_made:
                        raise _invalid(
                            f"{where}.content[{j}].tool_use_id",
                            "a tool_result answers a tool_use that no assistant turn before "
                            "it made",
                        )
        if isinstance(system, list):
            self._check_blocks(system, "system", "system")

    @staticmethod
    def _check_blocks(blocks: list[Block], where: str, role: str) -> None:
        """Text blocks anywhere; tool_use blocks in assistant turns, tool_result blocks
        in user turns, each with its own fields only."""
        allowed = {"system": ("text",), "user": ("text", "tool_result"),
                   "assistant": ("text", "tool_use", "thinking")}[role]  # fmt: skip
        for j, b in enumerate(blocks):
            at = f"{where}[{j}]"
            if b.type not in allowed:
                known = b.type in ("text", "tool_use", "tool_result", "thinking")
                raise ApiError(
                    "invalid_request",
                    f"{b.type} blocks belong to "
                    f"{'user' if b.type == 'tool_result' else 'assistant'} turns"
                    if known and role != "system"
                    else f"content blocks of {kind_name(b.type, _BLOCK_TYPES)} are not "
                    f"supported here; {', '.join(allowed)} blocks are",
                    param=f"{at}.type",
                    code="invalid_value" if known else "unsupported_parameter",
                )
            refuse_known(b, at)
            own = {"text": ("text",), "tool_use": ("id", "name", "input"),
                   "tool_result": ("tool_use_id",),
                   "thinking": ("thinking", "signature")}[b.type]  # fmt: skip
            others = {"text", "id", "name", "input", "tool_use_id", "content", "is_error",
                      "thinking", "signature"}  # fmt: skip
            for field in sorted(others - set(own) - ({"content", "is_error"}
                                if b.type == "tool_result" else set())):  # fmt: skip
                if getattr(b, field) is not None:
                    raise _invalid(f"{at}.{field}", f"a {b.type} block has no {field}",
                                   code="unknown_parameter")  # fmt: skip
            for field in own:
                if getattr(b, field) is None:
                    raise _invalid(f"{at}.{field}", f"a {b.type} block needs its {field}",
                                   code="missing_required_parameter")  # fmt: skip
            if b.type == "tool_use":
                check_tool_name(b.name, f"{at}.name")
            if b.type == "tool_result" and isinstance(b.content, list):
                AnthropicCodec._check_result_blocks(b.content, f"{at}.content")
            if b.caller is not None and (b.type != "tool_use" or b.caller != {"type": "direct"}):
                raise _invalid(f"{at}.caller", "only a direct caller of a tool_use is taken")

    @staticmethod
    def _check_result_blocks(blocks: list[ResultBlock], where: str) -> None:
        """A tool_result's content blocks: text, with a text; any other type is refused
        naming it (image and document as at the top level)."""
        for k, rb in enumerate(blocks):
            at = f"{where}[{k}]"
            if rb.type != "text":
                raise ApiError(
                    "invalid_request",
                    f"content blocks of {kind_name(rb.type, _BLOCK_TYPES)} are not supported "
                    "in a tool_result here; text blocks are",
                    param=f"{at}.type",
                    code="unsupported_parameter",
                )
            if rb.text is None:
                raise _invalid(f"{at}.text", "a text block needs its text",
                               code="missing_required_parameter")  # fmt: skip
            refuse_known(rb, at)

    @staticmethod
    def _check_tools(tools: list[AnthropicTool] | None, choice: ToolChoice | None) -> None:
        names: list[str] = []
        for i, tool in enumerate(tools or ()):
            if tool.input_schema is None:
                raise _invalid(f"tools[{i}].input_schema", "a tool needs its input_schema",
                               code="missing_required_parameter")  # fmt: skip
            if tool.defer_loading:
                raise ApiError(
                    "invalid_request",
                    "deferred tools need tool search, which this server does not have",
                    param=f"tools[{i}].defer_loading",
                    code="unsupported_parameter",
                )
            if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
                raise ApiError(
                    "invalid_request",
                    "a tool is called directly by the model here: allowed_callers must "
                    'include "direct" (this server has no code execution)',
                    param=f"tools[{i}].allowed_callers",
                    code="unsupported_parameter",
                )
            if tool.name in names:
                raise _invalid(f"tools[{i}].name", "two tools have the same name")
            names.append(tool.name)
        if choice is None:
            return
        if choice.type == "tool":
            if choice.name is None or choice.name not in names:
                raise _invalid("tool_choice.name",
                               "tool_choice of type tool names one of the tools")  # fmt: skip
        elif choice.name is not None:
            raise _invalid("tool_choice.name", "only tool_choice of type tool has a name")
        if choice.type in ("any", "tool") and not names:
            raise _invalid("tool_choice", "tool_choice needs tools to choose from")
        if choice.type == "none" and choice.disable_parallel_tool_use is not None:
            raise _invalid("tool_choice.disable_parallel_tool_use",
                           "tool_choice none takes no disable_parallel_tool_use")  # fmt: skip

    def parse_messages(self, body: Any) -> MessagesRequest:
        refuse_hosted_tools(body, (None, "custom"))
        req = structure(self._conv, body, MessagesRequest)
        if req.thread is not None:
            raise ApiError(
                "invalid_request",
                "message threads are not kept by this server: send the whole conversation "
                "without thread",
                param="thread",
                code="thread_unsupported_request",
            )
        self._check_conversation(req.messages, req.system, req.unsupported())
        _check_thinking(req.thinking, req.max_tokens)
        self._check_tools(req.tools, req.tool_choice)
        if req.messages[-1].role != "user":
            raise _invalid(
                f"messages[{len(req.messages) - 1}].role",
                "the last message must be from the user (assistant prefill is not supported)",
            )
        check_limits(req)
        return req

    def parse_count(self, body: Any) -> CountTokensRequest:
        refuse_hosted_tools(body, (None, "custom"))
        req = structure(self._conv, body, CountTokensRequest)
        self._check_conversation(req.messages, req.system, {})
        _check_thinking(req.thinking, None)
        self._check_tools(req.tools, req.tool_choice)
        return req


AnthropicMessage = Message  # the public name of one message of a Messages request
AnthropicThinking = ThinkingConfig
AnthropicToolChoice = ToolChoice
