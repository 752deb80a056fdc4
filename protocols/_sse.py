"""Server-sent events framing."""

from __future__ import annotations

from typing import Any

from protocols._json import dumps

__all__ = ["sse_data", "sse_event"]


def sse_event(event: str | None, data: Any) -> bytes:
    """One SSE frame: optional `event:` line, one `data:` line of compact JSON."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + dumps(data) + b"\n\n"


def sse_data(raw: bytes) -> bytes:
    """A frame whose data is already-encoded bytes (e.g. OpenAI's `[DONE]`)."""
    return b"data: " + raw + b"\n\n"
