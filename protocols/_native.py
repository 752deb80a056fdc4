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

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._json import dumps
from protocols._schema import schema
from protocols._strict import (
    check_sampling,
    invalid_value,
    make_converter,
    register_list,
    structure,
)

__all__ = [
    "MAX_SEED",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "GenerateRequest",
    "NativeCodec",
    "error_body",
    "response_body",
]

MAX_STOPS = 4
MAX_STOP_CHARS = 32
MAX_SEED = 2**31 - 1


def _check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOPS:
        raise invalid_value(
            "stop", f"stop has {len(stop)} strings; at most {MAX_STOPS} are allowed"
        )
    if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in stop):
        raise invalid_value("stop", f"stop strings must be 1..{MAX_STOP_CHARS} characters long")


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


def _range_error(param: str, rule: str) -> ApiError:
    return invalid_value(param, f"{param} {rule}")


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
    if not req.prompt:
        raise _range_error("prompt", "must be a non-empty string")
    # Above the context is the budget's to refuse (context_length_exceeded, with numbers).
    if req.max_new_tokens is not None and req.max_new_tokens < 1:
        raise _range_error("max_new_tokens", "must be at least 1")
    check_sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        max_temperature=2.0,
    )
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise _range_error("seed", f"must be between 0 and {MAX_SEED}")
    if req.stop is not None:
        _check_stop(req.stop)
    return req


def error_body(err: ApiError, request_id: str) -> bytes:
    return dumps(
        {
            "error": {
                "type": err.kind,
                "message": err.message,
                "param": err.param,
                "request_id": request_id,
            }
        }
    )


def response_body(
    *,
    request_id: str,
    model: Mapping[str, Any],
    text: str,
    token_ids: Sequence[int],
    finish_reason: str,
    stop_sequence: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    warnings: Sequence[str],
    timing: Mapping[str, float],
    seed: int | None,
) -> bytes:
    return dumps(
        {
            "id": request_id,
            "model": dict(model),
            "text": text,
            "token_ids": list(token_ids),
            "finish_reason": finish_reason,
            "stop_sequence": stop_sequence,
            "seed": seed,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "warnings": list(warnings),
            "timing": dict(timing),
        }
    )
