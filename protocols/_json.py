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
        # orjson's reason is a fixed phrase ("unexpected character, expected a string
        # key"), never a piece of the input.
        reason = str(exc).split(":", 1)[0]
        low = reason.lower()
        if "utf-8" in low or "surrogate" in low:
            reason = "invalid UTF-8 or a lone surrogate escape"
        elif "depth" in low or "recursion" in low:
            reason = "nesting deeper than 1024 levels"
        elif "infinity" in low:
            reason = "a number out of range"
        elif _non_finite_at(body, exc.pos):
            reason = "NaN and Infinity are not JSON numbers"
        where = _POSITION.search(str(exc))
        at = f" at {where.group(0)}" if where else ""
        raise ApiError(
            "malformed_json", f"the request body is not valid JSON: {reason}{at}"
        ) from None


def _non_finite_at(body: bytes, pos: int) -> bool:
    """Whether the text at character `pos` is NaN or (-)Infinity (orjson refuses them
    as an unexpected character or a sign without digits)."""
    text = body.decode("utf-8", "replace")
    return any(text.startswith(word, p) for p in (pos, pos - 1) for word in _NON_FINITE)


_NON_FINITE = ("NaN", "Infinity", "-Infinity")


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)
