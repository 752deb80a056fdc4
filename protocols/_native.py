"""The native contract: POST /v1/generate.

Request fields (strict JSON types, unknown fields refused):
  prompt          non-empty string
  max_new_tokens  integer >= 1 (default: the server's --default-max-tokens)
  temperature     number 0..2; 0 is greedy (default: the server's)
  top_k           integer >= 0; 0 is off
  top_p           number in (0, 1]
  min_p           number in [0, 1)
  seed            integer 0..2^31-1
  stop            array of up to 4 strings, each 1..32 characters
  stream          boolean
  ignore_eos      boolean: keep generating past end-of-sequence (benchmarks)

Errors: `{"error": {"type", "message", "param", "request_id"}}` with the status of
`protocols._errors.KINDS`.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._schema import check_limits, schema
from protocols._strict import make_converter, register_list, structure

__all__ = [
    "MAX_SEED",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "GenerateRequest",
    "NativeCodec",
]

MAX_STOPS = 4
MAX_STOP_CHARS = 32
MAX_SEED = 2**31 - 1


@attrs.frozen
class GenerateRequest:
    """A native generation request (POST /v1/generate)."""

    prompt: str = attrs.field(metadata=schema(minLength=1))
    max_new_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1))
    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=2))
    top_k: int | None = attrs.field(default=None, metadata=schema(minimum=0))
    top_p: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0, maximum=1))
    min_p: float | None = attrs.field(default=None, metadata=schema(minimum=0, exclusiveMaximum=1))
    seed: int | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=MAX_SEED))
    stop: list[str] | None = attrs.field(
        default=None,
        metadata=schema(maxItems=MAX_STOPS, items={"minLength": 1, "maxLength": MAX_STOP_CHARS}),
    )
    stream: bool = False
    ignore_eos: bool = False
    # A JSON schema the output must match, enforced while decoding (as OpenAI's
    # response_format json_schema; `{}` or `{"type": "object"}`: any object).
    json_schema: dict[str, Any] | None = None


class NativeCodec:
    """Parses native requests with its own strict converter (one per app, never global)."""

    def __init__(self) -> None:
        self._conv = make_converter()
        register_list(self._conv, str)

    def parse_generate(self, body: Any) -> GenerateRequest:
        return parse_generate(self._conv, body)


def parse_generate(conv: cattrs.Converter, body: Any) -> GenerateRequest:
    """Structure and range-check a parsed body; raise ApiError naming the parameter."""
    if isinstance(body, dict):
        for key in ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens", "stop"):
            if key in body and body[key] is None:
                raise ApiError(
                    "invalid_request",
                    f"{key} must not be null; omit it to use the default",
                    param=key,
                    code="invalid_type",
                )
    req = structure(conv, body, GenerateRequest)
    # Above the context is the budget's to refuse (context_length_exceeded, with numbers).
    check_limits(req)
    return req
