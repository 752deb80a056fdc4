"""The Anthropic-compatible contract: POST /v1/messages and /v1/messages/count_tokens.

Text only: image, document, tool and thinking blocks, `tools`, `tool_choice` and
`thinking` are refused by name. The `model` field names a served model (the server checks it).
Errors: `{"type": "error", "error": {"type", "message"}, "request_id"}`.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._schema import check_limits, schema
from protocols._strict import (
    invalid_value,
    kind_name,
    make_converter,
    register_list,
    register_text_or_list,
    structure,
)

__all__ = [
    "AnthropicCodec",
    "AnthropicMessage",
    "CountTokensRequest",
    "MessagesRequest",
]


_BLOCK_TYPES = frozenset(
    {"image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
     "search_result", "server_tool_use", "web_search_tool_result", "container_upload"}
)  # fmt: skip


_REFUSED = schema(refused=True)


@attrs.frozen
class Block:
    type: str = attrs.field(metadata=schema(enum=["text"]))
    text: str | None = None
    # Present only so that a non-text block is refused by its type, not by its fields.
    source: dict[str, Any] | None = attrs.field(default=None, metadata=_REFUSED)
    id: str | None = attrs.field(default=None, metadata=_REFUSED)
    name: str | None = attrs.field(default=None, metadata=_REFUSED)
    input: dict[str, Any] | None = attrs.field(default=None, metadata=_REFUSED)
    tool_use_id: str | None = attrs.field(default=None, metadata=_REFUSED)
    content: Any = attrs.field(default=None, metadata=_REFUSED)
    thinking: str | None = attrs.field(default=None, metadata=_REFUSED)
    signature: str | None = attrs.field(default=None, metadata=_REFUSED)
    is_error: bool | None = attrs.field(default=None, metadata=_REFUSED)  # of a tool_result
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None  # on text a client sends back: no effect


@attrs.frozen
class Message:
    role: str = attrs.field(metadata=schema(enum=["user", "assistant"]))
    content: str | list[Block]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text or "" for b in self.content)


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
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

    def system_text(self) -> str | None:
        return _system_text(self.system)

    def unsupported(self) -> dict[str, Any]:
        """The fields refused by name when sent."""
        names = ("tools", "tool_choice", "thinking", "container", "mcp_servers",
                 "output_config", "speed", "diagnostics", "context_management")  # fmt: skip
        return {name: getattr(self, name) for name in names}


@attrs.frozen
class CountTokensRequest:
    """An Anthropic token-count request (POST /v1/messages/count_tokens)."""

    model: str
    messages: list[Message] = attrs.field(metadata=schema(minItems=1))
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def system_text(self) -> str | None:
        return _system_text(self.system)


_invalid = invalid_value


class AnthropicCodec:
    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, str)
        register_list(conv, Message)
        register_list(conv, dict[str, Any])
        conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)
        register_text_or_list(conv, Block, "content blocks")
        self._conv: cattrs.Converter = conv

    def _check_conversation(
        self, messages: list[Message], system: str | list[Block] | None, refused: dict[str, Any]
    ) -> None:
        for name, value in refused.items():
            if value is not None:
                why = (
                    " (the model's chat template has no tool or thinking support)"
                    if name in ("tools", "tool_choice", "thinking")
                    else ""
                )
                raise ApiError(
                    "invalid_request",
                    f"{name} is not supported by this server{why}",
                    param=name,
                    code="unsupported_parameter",
                )
        if not messages:
            raise _invalid("messages", "messages must contain at least one message")
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
                self._check_blocks(m.content, f"{where}.content")
        if isinstance(system, list):
            self._check_blocks(system, "system")

    @staticmethod
    def _check_blocks(blocks: list[Block], where: str) -> None:
        for j, b in enumerate(blocks):
            if b.type != "text":
                raise ApiError(
                    "invalid_request",
                    f"content blocks of {kind_name(b.type, _BLOCK_TYPES)} are not supported; "
                    "only text blocks are",
                    param=f"{where}[{j}].type",
                    code="unsupported_parameter",
                )
            if b.text is None:
                raise _invalid(f"{where}[{j}].text", "a text block needs its text")

    def parse_messages(self, body: Any) -> MessagesRequest:
        req = structure(self._conv, body, MessagesRequest)
        self._check_conversation(req.messages, req.system, req.unsupported())
        if req.messages[-1].role != "user":
            raise _invalid(
                f"messages[{len(req.messages) - 1}].role",
                "the last message must be from the user (assistant prefill is not supported)",
            )
        check_limits(req)
        return req

    def parse_count(self, body: Any) -> CountTokensRequest:
        req = structure(self._conv, body, CountTokensRequest)
        self._check_conversation(
            req.messages,
            req.system,
            {"tools": req.tools, "tool_choice": req.tool_choice, "thinking": req.thinking},
        )
        return req


AnthropicMessage = Message  # the public name of one message of a Messages request
