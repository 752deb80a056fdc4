"""The protocol-neutral error: one stable machine `kind`, a message, the parameter at fault.

    ProtocolError
    └── ApiError      carries `kind` (see KINDS), `message`, `param`, `retry_after`, `allow`

Each protocol turns an ApiError into its own envelope and status in one place
(`protocols._native.error_response`, and the OpenAI/Anthropic modules). Messages
never echo the client's input and never carry a traceback or a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

__all__ = ["KINDS", "ApiError", "ErrorKind", "ProtocolError"]

ErrorKind = Literal[
    "bad_request",
    "malformed_json",
    "unauthorized",
    "feature_disabled",
    "not_found",
    "model_not_found",
    "method_not_allowed",
    "request_timeout",
    "payload_too_large",
    "unsupported_media_type",
    "invalid_request",
    "context_length_exceeded",
    "server_overloaded",
    "request_queue_timeout",
    "model_loading",
    "shutting_down",
    "engine_unavailable",
    "internal_error",
]

# The native endpoint's status for each kind (docs/errors.md states the rule).
KINDS: Mapping[ErrorKind, int] = {
    "bad_request": 400,
    "malformed_json": 400,
    "unauthorized": 401,
    "feature_disabled": 403,
    "not_found": 404,
    "model_not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "invalid_request": 422,
    "context_length_exceeded": 422,
    "server_overloaded": 429,
    "request_queue_timeout": 503,
    "model_loading": 503,
    "shutting_down": 503,
    "engine_unavailable": 503,
    "internal_error": 500,
}


class ProtocolError(Exception):
    """Base of the protocol package's errors."""


class ApiError(ProtocolError):
    """A failure to report to the client, in whatever protocol it spoke."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        retry_token: str | None = None,
        allow: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.param = param
        self.code = code  # a finer machine code where a protocol has one (unknown_parameter)
        self.retry_after = retry_after  # seconds; written as Retry-After and retry-after-ms
        self.retry_token = retry_token  # the promise of a place, as ninfer-retry-token
        self.allow = allow

    @property
    def status(self) -> int:
        return KINDS[self.kind]
