"""Strict JSON in and out (orjson): NaN, Infinity, lone surrogates and deep nesting refused."""

from __future__ import annotations

import re
from typing import Any

import orjson

from protocols._errors import ApiError

__all__ = ["dumps", "loads"]

_POSITION = re.compile(r"line \d+ column \d+")


def loads(body: bytes) -> Any:
    """Parse a request body; any failure is `malformed_json` with the position, never the input."""
    if not body.strip():
        raise ApiError("malformed_json", "the request body is empty; a JSON object is required")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = str(exc).split(":", 1)[0]
        if "utf-8" in reason.lower() or "surrogate" in reason.lower():
            reason = "invalid UTF-8 or a lone surrogate escape"
        elif "depth" in reason.lower():
            reason = "nesting deeper than 1024 levels"
        elif "infinity" in reason.lower():
            reason = "a number out of range"
        else:
            reason = "invalid JSON syntax (NaN and Infinity are not JSON)"
        where = _POSITION.search(str(exc))
        at = f" at {where.group(0)}" if where else ""
        raise ApiError(
            "malformed_json", f"the request body is not valid JSON: {reason}{at}"
        ) from None


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)
