"""ASGI plumbing: headers, bounded body reading, plain responses, the disconnect watch."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from protocols import ApiError

__all__ = [
    "ClientGone",
    "Headers",
    "discard_body",
    "header",
    "read_body",
    "request_id_from",
    "send_bytes",
    "worth_draining",
]

Headers = list[tuple[bytes, bytes]]

_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def header(scope: HTTPScope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


def request_id_from(scope: HTTPScope) -> str:
    """The client's X-Request-Id when it is sane (1-128 of [A-Za-z0-9._:-]), else a new one."""
    raw = header(scope, b"x-request-id")
    if raw is not None:
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if _SANE_ID.fullmatch(text):
            return text
    return "req-" + uuid.uuid4().hex


class ClientGone(Exception):
    """The client disconnected; `stage` says when."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


async def read_body(scope: HTTPScope, receive: ASGIReceiveCallable, limit: int) -> bytes:
    """The whole body, refused with 413 past `limit` bytes: by the declared Content-Length
    before reading anything, and by counting what arrives (chunked bodies). The caller
    puts a deadline around this (408)."""
    declared = header(scope, b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError("malformed_json", "Content-Length is not a number") from None
        if size > limit:
            raise ApiError(
                "payload_too_large",
                f"the request body of {size} bytes exceeds the limit of {limit} bytes",
            )
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("body")
        chunk = message["body"] if message["type"] == "http.request" else b""
        total += len(chunk)
        if total > limit:
            raise ApiError(
                "payload_too_large", f"the request body exceeds the limit of {limit} bytes"
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(
    send: ASGISendCallable,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    content_type: bytes = b"application/json",
) -> None:
    hdrs: Headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send(
        {"type": "http.response.start", "status": status, "headers": hdrs, "trailers": False}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def worth_draining(scope: HTTPScope, kind: str) -> bool:
    """Whether to drain the unread body before refusing: not for a stalled upload (it
    would only wait longer), nor for an oversized one the client has not started to send
    (`Expect: 100-continue`: reading would invite the upload). An oversized body that is
    being sent is drained up to the same bound again, so that a body up to twice the
    limit gets its 413 instead of a reset."""
    if kind == "request_timeout":
        return False
    expect = header(scope, b"expect")
    return not (
        kind == "payload_too_large"
        and expect is not None
        and expect.strip().lower() == b"100-continue"
    )


async def discard_body(receive: ASGIReceiveCallable, limit: int, seconds: float) -> None:
    """Read and drop an unread request body, bounded in bytes and time, before refusing
    the request: a connection closed with unread data is reset by the kernel, and the
    client may then lose the answer."""
    remaining = limit
    with trio.move_on_after(seconds):
        while remaining > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            remaining -= len(message["body"])
            if not message.get("more_body", False):
                return
