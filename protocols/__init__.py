"""Wire contracts: strict request parsing, error envelopes and responses, sans-IO.

Imports neither trio nor torch: pure data and translation.
"""

from __future__ import annotations

from protocols._anthropic import (
    AnthropicCodec,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    anthropic_status,
)
from protocols._compat import Break, classify
from protocols._errors import KINDS, ApiError, ErrorKind, ProtocolError
from protocols._json import dumps, loads
from protocols._native import GenerateRequest, NativeCodec, error_body, response_body
from protocols._openai import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    OpenAICodec,
    openai_error_body,
    openai_status,
)
from protocols._openapi import openapi_document
from protocols._sse import sse_data, sse_event

__all__ = [
    "KINDS",
    "AnthropicCodec",
    "ApiError",
    "Break",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "CountTokensRequest",
    "ErrorKind",
    "GenerateRequest",
    "MessagesRequest",
    "NativeCodec",
    "OpenAICodec",
    "ProtocolError",
    "anthropic_error_body",
    "anthropic_status",
    "classify",
    "dumps",
    "error_body",
    "loads",
    "openai_error_body",
    "openai_status",
    "openapi_document",
    "response_body",
    "sse_data",
    "sse_event",
]
