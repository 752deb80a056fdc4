"""The OpenAI-compatible contract: /v1/chat/completions, /v1/completions, /v1/models.

Every field the OpenAI clients send is honoured, refused by name, or (where
harmless, and listed in docs/api.md) accepted without effect. Unknown fields are
refused with code `unknown_parameter`. Errors use OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._schema import check_limits, schema
from protocols._strict import (
    InvalidType,
    kind_name,
    make_converter,
    register_list,
    structure,
)

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "OpenAICodec",
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
class ChatMessage:
    role: str = attrs.field(
        metadata=schema(enum=["system", "developer", "user", "assistant", "tool"])
    )
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ResponseFormat:
    type: str


@attrs.frozen
class ChatRequest:
    """An OpenAI chat completion request (POST /v1/chat/completions)."""

    model: str
    messages: list[ChatMessage] = attrs.field(metadata=schema(minItems=1))
    max_completion_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1))
    max_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1))
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
    n: int | None = attrs.field(default=None, metadata=schema(minimum=1, maximum=1))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    ignore_eos: bool | None = None


@attrs.frozen
class CompletionRequest:
    """An OpenAI text completion request (POST /v1/completions)."""

    model: str
    prompt: str
    max_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1, default=16))
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
    n: int | None = attrs.field(default=None, metadata=schema(minimum=1, maximum=1))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None


_PART_TYPES = frozenset({"image_url", "input_audio", "file", "refusal"})
_FORMATS = frozenset({"json_object", "json_schema"})


def _invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError("invalid_request", message, param=param, code=code)


class OpenAICodec:
    """Strict parsing for the OpenAI routes; one converter per app, never global."""

    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, str)
        register_list(conv, TextPart)
        register_list(conv, ChatMessage)
        register_list(conv, dict[str, Any])

        def content_hook(value: Any, _: type) -> str | list[TextPart] | None:
            if value is None or isinstance(value, str):
                return value
            if isinstance(value, list):
                return conv.structure(value, list[TextPart])
            raise InvalidType("string or array of content parts")

        def stop_hook(value: Any, _: type) -> str | list[str] | None:
            if value is None or isinstance(value, str):
                return value
            if isinstance(value, list):
                return conv.structure(value, list[str])
            raise InvalidType("string or array of strings")

        def tool_choice_hook(value: Any, _: type) -> str | dict[str, Any] | None:
            if value is None or isinstance(value, str | dict):
                return value
            raise InvalidType("string or object")

        conv.register_structure_hook_func(
            lambda t: t == (str | list[TextPart] | None), content_hook
        )
        conv.register_structure_hook_func(lambda t: t == (str | list[str] | None), stop_hook)
        conv.register_structure_hook_func(
            lambda t: t == (str | dict[str, Any] | None), tool_choice_hook
        )
        self._conv: cattrs.Converter = conv

    def parse_chat(self, body: Any, *, supports_tools: bool) -> ChatRequest:
        req = structure(self._conv, body, ChatRequest)
        if not req.messages:
            raise _invalid("messages", "messages must contain at least one message")
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
            if m.content is None and m.role != "assistant":
                raise _invalid(f"{where}.content", f"{where}.content is required")
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
        if (req.tools or req.tool_choice not in (None, "none")) and not supports_tools:
            raise ApiError(
                "invalid_request",
                "this model's chat template has no tool support; tools and tool_choice "
                "cannot be honoured",
                param="tools" if req.tools else "tool_choice",
                code="unsupported_parameter",
            )
        if (
            req.max_tokens is not None
            and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens
        ):
            raise _invalid(
                "max_tokens",
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
            )
        if req.logprobs or req.top_logprobs is not None:
            raise ApiError(
                "invalid_request",
                "logprobs are not supported by this server",
                param="logprobs" if req.logprobs else "top_logprobs",
                code="unsupported_parameter",
            )
        if req.response_format is not None and req.response_format.type != "text":
            raise ApiError(
                "invalid_request",
                f"response_format {kind_name(req.response_format.type, _FORMATS)} is not "
                "supported; only 'text' is",
                param="response_format.type",
                code="unsupported_parameter",
            )
        _check_n(req.n)
        check_limits(req)
        return req

    def parse_completion(self, body: Any) -> CompletionRequest:
        req = structure(self._conv, body, CompletionRequest)
        # Refused since v0.1 but never declared as minLength in the published contract:
        # declaring it now would read as a tightened limit to `ninfer openapi --compare`.
        if not req.prompt:
            raise _invalid("prompt", "prompt must be a non-empty string")
        if req.echo:
            raise ApiError(
                "invalid_request",
                "echo is not supported by this server",
                param="echo",
                code="unsupported_parameter",
            )
        for name in ("logprobs", "suffix", "best_of"):
            value = getattr(req, name)
            if value is not None and not (name == "best_of" and value == 1):
                raise ApiError(
                    "invalid_request",
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        _check_n(req.n)
        check_limits(req)
        return req


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise ApiError(
            "invalid_request", "only n=1 is supported", param="n", code="unsupported_parameter"
        )
