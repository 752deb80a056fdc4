"""How each protocol answers: its answers encoded from the attrs classes of
`protocols._answers`, and its refusals (status, envelope, request-id header,
the error frame of a stream that has already begun).

    Dialect                 one per protocol (a frontend class's)
    ├── NativeDialect       /v1/generate: the native statuses, `{"error": {...}}`
    ├── OpenAIDialect       400 for anything invalid, OpenAI's envelope and types
    └── AnthropicDialect    400 for anything invalid, Anthropic's envelope and types

A refusal becomes a wire envelope here and nowhere else.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from protocols._answers import (
    AnthropicError,
    AnthropicErrorBody,
    AnthropicErrorDetails,
    NativeError,
    NativeErrorBody,
    OpenAIError,
    OpenAIErrorBody,
)
from protocols._errors import ApiError
from protocols._json import dumps

__all__ = ["AnthropicDialect", "Dialect", "Encoder", "NativeDialect", "OpenAIDialect"]


class Encoder:
    """Answer objects (attrs classes of `protocols._answers`) to compact JSON and SSE
    frames. A field left at its default of None is omitted (a chunk's `usage`, a
    delta's `role`); a field without a default, or a tag the class fixes (`type`,
    `object`), is always written, null or not."""

    def __init__(self) -> None:
        self._conv = cattrs.Converter(omit_if_default=True)
        self._conv.register_unstructure_hook_factory(attrs.has, self._writes_tags)

    def _writes_tags(self, cls: type) -> Any:
        keep = override(omit_if_default=False)
        tags = {f.name: keep for f in attrs.fields(cls) if f.metadata.get("tag")}
        make: Any = make_dict_unstructure_fn  # its overrides are keywords typed apart
        return make(cls, self._conv, _cattrs_omit_if_default=True, **tags)

    def json(self, answer: Any) -> bytes:
        assert attrs.has(type(answer)), "answers are built from the protocol classes"
        return dumps(self._conv.unstructure(answer))

    def sse(self, answer: Any, event: str | None = None) -> bytes:
        """One SSE frame: an optional `event:` line and one `data:` line. Characters that
        JSON may carry raw but that Python's `str.splitlines` takes for line ends (NEL,
        U+2028, U+2029: httpx's `aiter_lines` splits on them) are written as \\u escapes,
        so a generated text can never cut a client's line in two."""
        head = f"event: {event}\n".encode() if event else b""
        return head + b"data: " + _escape_line_ends(self.json(answer)) + b"\n\n"


# In valid UTF-8 these byte sequences are always these characters (C2 and E2 lead a
# character), and in JSON they only occur inside strings, where the escape is equal.
_LINE_ENDS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
              (b"\xe2\x80\xa9", b"\\u2029"))  # fmt: skip


def _escape_line_ends(data: bytes) -> bytes:
    for raw, escaped in _LINE_ENDS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


class Dialect:
    """A protocol's refusals; subclasses fill in the envelope and the status rule."""

    name: ClassVar[str]
    request_id_header: ClassVar[bytes] = b"x-request-id"

    def __init__(self) -> None:
        self.encoder = Encoder()

    def status(self, err: ApiError) -> int:
        return err.status

    def envelope(self, err: ApiError, request_id: str) -> Any:
        raise NotImplementedError

    def error_body(self, err: ApiError, request_id: str) -> bytes:
        return self.encoder.json(self.envelope(err, request_id))

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]:
        """The frames that end a stream which fails after it has begun."""
        return [self.encoder.sse(self.envelope(err, request_id), "error")]


class NativeDialect(Dialect):
    name = "native"

    def envelope(self, err: ApiError, request_id: str) -> NativeErrorBody:
        return NativeErrorBody(
            error=NativeError(
                type=err.kind, message=err.message, param=err.param, request_id=request_id
            )
        )


_INVALID = frozenset({"invalid_request", "context_length_exceeded", "malformed_json"})

_OPENAI_TYPES = {
    "unauthorized": "invalid_request_error",  # with code invalid_api_key, as OpenAI answers
    "not_found": "invalid_request_error",
    "model_not_found": "invalid_request_error",
    "server_overloaded": "rate_limit_error",
    "request_queue_timeout": "server_error",
    "model_loading": "server_error",
    "shutting_down": "server_error",
    "engine_unavailable": "server_error",
    "internal_error": "server_error",
}


class OpenAIDialect(Dialect):
    name = "openai"

    def status(self, err: ApiError) -> int:
        """OpenAI's convention: 400 for every invalid request, else the native status."""
        return 400 if err.kind in _INVALID else err.status

    def envelope(self, err: ApiError, request_id: str) -> OpenAIErrorBody:
        code = "invalid_api_key" if err.kind == "unauthorized" else err.code or err.kind
        kind = _OPENAI_TYPES.get(err.kind, "invalid_request_error")
        return OpenAIErrorBody(
            error=OpenAIError(message=err.message, type=kind, param=err.param, code=code)
        )

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]:
        # OpenAI streams are data-only lines, ended by [DONE] whatever happened.
        return [self.encoder.sse(self.envelope(err, request_id)), b"data: [DONE]\n\n"]


_ANTHROPIC_TYPES = {
    "bad_request": "invalid_request_error",
    "malformed_json": "invalid_request_error",
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "request_timeout": "timeout_error",
    "unauthorized": "authentication_error",
    "feature_disabled": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "payload_too_large": "request_too_large",
    "server_overloaded": "rate_limit_error",
    "request_queue_timeout": "overloaded_error",
    "model_loading": "overloaded_error",
    "shutting_down": "overloaded_error",
    "engine_unavailable": "overloaded_error",
    "internal_error": "api_error",
}


# The codes Anthropic's SDKs act on, written as `error.details.error_code`: on
# thread_unsupported_request their tool runners send the turn again without `thread`.
_ANTHROPIC_CODES = frozenset({"thread_unsupported_request"})


class AnthropicDialect(Dialect):
    name = "anthropic"
    request_id_header = b"request-id"

    def status(self, err: ApiError) -> int:
        return 400 if err.kind in _INVALID else err.status

    def envelope(self, err: ApiError, request_id: str) -> AnthropicErrorBody:
        # No `param` in this envelope: the message starts with it and a colon (once, where
        # the message already began with it).
        message = err.message
        if err.param is not None:
            message = f"{err.param}: {message.removeprefix(err.param + ' ')}"
        kind = _ANTHROPIC_TYPES.get(err.kind, "api_error")
        details = (
            AnthropicErrorDetails(error_code=err.code) if err.code in _ANTHROPIC_CODES else None
        )
        return AnthropicErrorBody(
            error=AnthropicError(type=kind, message=message, details=details),
            request_id=request_id,
        )
