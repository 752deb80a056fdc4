"""ASGI plumbing: headers, bounded body reading, plain responses, refusals in a
protocol's dialect, CORS, and the exchange bookkeeping the app routes with."""

from __future__ import annotations

import hmac
import ipaddress
import math
import re
import uuid
from collections.abc import Iterable, Sequence

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    HTTPScope,
    WebsocketScope,
)

from protocols import ApiError, Dialect
from scheduler import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S

__all__ = [
    "ClientGone",
    "Exchange",
    "Headers",
    "authorize",
    "header",
    "preflight",
    "read_body",
    "request_id_from",
    "send_bytes",
    "send_refusal",
    "with_cors",
]

# How long a refused request's unread body may take to arrive before the answer.
DISCARD_BODY_S = 1.0
# After a 413 is sent, how long and how much more of the upload is read and dropped.
LINGER_S = 10.0
LINGER_BYTES = 256 << 20

Headers = list[tuple[bytes, bytes]]

_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def authorize(scope: HTTPScope, key: str | None) -> None:
    """Refuse (401) a request without the API key, where one is set: `x-api-key` or
    `Authorization: Bearer`, compared in constant time. Every key the request presents
    must be the key: a second header (repeated, or the other kind) with another value
    does not ride on a right one."""
    if key is None:
        return
    presented = [bytes(v) for k, v in scope["headers"] if k.lower() == b"x-api-key"]
    presented += [
        bytes(v)[7:].strip()
        for k, v in scope["headers"]
        if k.lower() == b"authorization" and bytes(v)[:7].lower() == b"bearer "
    ]
    expected = key.encode()
    # (each compared: no early exit on the first wrong one)
    right = [hmac.compare_digest(p, expected) for p in presented]
    if not right or not all(right):
        raise ApiError(
            "unauthorized", "a valid API key is required (Authorization: Bearer or x-api-key)"
        )


def header(scope: HTTPScope | WebsocketScope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


Networks = Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]


def trusted_networks(proxies: Sequence[str] | None) -> Networks:
    """--trusted-proxies as networks (the config checked each)."""
    return tuple(ipaddress.ip_network(p.strip(), strict=False) for p in proxies or ())


def client_address(scope: HTTPScope, trusted: Networks) -> str | None:
    """Who sent the request, as the scheduler knows clients apart: the peer's address;
    where the peer is a trusted proxy (--trusted-proxies), the last address of its
    X-Forwarded-For that is not one (the client as the first trusted proxy saw it: what
    came before it, the client could have written). None where there is no peer (an
    in-process call)."""
    client = scope.get("client")
    if not client:
        return None
    peer = str(client[0])
    if not trusted or not _within(peer, trusted):
        return peer
    forwarded = header(scope, b"x-forwarded-for")
    if forwarded is None:
        return peer
    for hop in reversed(forwarded.decode("latin-1").split(",")):
        hop = hop.strip()
        if not _within(hop, trusted):
            return hop if _address(hop) is not None else peer  # a malformed hop: the proxy's
    return peer


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _within(text: str, networks: Networks) -> bool:
    address = _address(text)
    return address is not None and any(address in n for n in networks)


def request_id_from(scope: HTTPScope | WebsocketScope) -> str:
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


async def read_body(
    scope: HTTPScope, receive: ASGIReceiveCallable, limit: int, deadline: float
) -> bytes:
    """The whole body by `deadline` (absolute Trio time), else 408; refused with 413 past
    `limit` bytes: by the declared Content-Length before reading anything, and by
    counting what arrives (chunked bodies)."""
    with trio.move_on_at(deadline):
        return await _read_body(scope, receive, limit)
    raise ApiError("request_timeout", "the request body did not arrive in time")


async def _read_body(scope: HTTPScope, receive: ASGIReceiveCallable, limit: int) -> bytes:
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


def _start(
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    content_type: bytes = b"application/json",
) -> ASGISendEvent:
    hdrs: Headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    return {"type": "http.response.start", "status": status, "headers": hdrs, "trailers": False}


async def send_bytes(
    send: ASGISendCallable,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    content_type: bytes = b"application/json",
) -> None:
    await send(_start(status, body, headers, content_type))
    await send({"type": "http.response.body", "body": body, "more_body": False})


def worth_draining(scope: HTTPScope, kind: str) -> bool:
    """Whether to drain the unread body before refusing: not for a stalled upload (it
    would only wait longer), nor for an oversized one the client has not started to send
    (`Expect: 100-continue`: reading would invite the upload). An oversized body that is
    being sent is drained up to the same bound again, so that a body up to twice the
    limit gets its 413 instead of a reset."""
    if kind in ("request_timeout", "bad_request"):  # a stalled upload; framing not trusted
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


class Exchange:
    """One HTTP exchange's ASGI callables, noting the response status once it starts
    and whether the request body has been read to its end."""

    def __init__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        self.raw_receive = receive
        self._send = send
        self.status = 0  # 0 until http.response.start has been sent
        self.body_done = False

    async def send(self, message: ASGISendEvent) -> None:
        """Send, turning a broken connection into ClientGone: a failure of the transport
        is the client gone, never an internal error of the request. (Hypercorn can also
        report a client that closed right after the last byte as a busy stream.)"""
        if message["type"] == "http.response.start":
            self.status = message["status"]
        try:
            await self._send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            raise ClientGone("respond") from None

    async def receive(self) -> ASGIReceiveEvent:
        message = await self.raw_receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message


def cors_origin(allowed: str | None, scope: HTTPScope) -> bytes | None:
    """The Access-Control-Allow-Origin to send: `*` when any origin is allowed, the
    request's Origin when it is in the allowed list, else none (CORS off, or an origin
    not allowed: the browser then refuses the answer to the page)."""
    if allowed is None:
        return None
    if allowed == "*":
        return b"*"
    origin = header(scope, b"origin")
    if origin is not None and origin.decode("latin-1") in allowed_origins(allowed):
        return origin
    return None


def allowed_origins(allowed: str) -> frozenset[str]:
    return frozenset(o.strip().rstrip("/") for o in allowed.split(",") if o.strip())


def _cors_headers(headers: Headers, origin: bytes) -> Headers:
    """`headers` with the allowed origin; `Vary: origin` (one Vary header, merged with
    one already there) where the answer depends on the request's Origin."""
    out = [*headers, (b"access-control-allow-origin", origin)]
    if origin != b"*":
        vary = [v for k, v in out if k == b"vary"]
        out = [(k, v) for k, v in out if k != b"vary"]
        out.append((b"vary", b", ".join([*vary, b"origin"])))
    return out


def with_cors(send: ASGISendCallable, origin: bytes) -> ASGISendCallable:
    async def cors_send(message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start":
            headers = _cors_headers(list(message.get("headers", [])), origin)
            headers.append(
                (
                    b"access-control-expose-headers",
                    b"x-request-id, request-id, retry-after, retry-after-ms, server-timing, "
                    b"x-ninfer-max-tokens-clamped, ninfer-retry-token",
                )
            )
            message = {**message, "headers": headers}
        await send(message)

    return cors_send


# Sent when a preflight names no headers (the ones ninfer's clients use).
_DEFAULT_ALLOWED_HEADERS = (
    b"authorization, content-type, x-api-key, x-request-id, anthropic-version"
)
# A preflight's Access-Control-Request-Headers: comma-separated header names, bounded.
_HEADER_LIST = re.compile(
    rb"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(?:[ \t]*,[ \t]*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$"
)
_HEADER_LIST_MAX = 4096


async def preflight(send: ASGISendCallable, scope: HTTPScope) -> None:
    """The answer to a CORS preflight; `send` adds the allowed origin (`with_cors`).
    Every header the page asks to send is allowed (the browser SDKs send their own:
    x-stainless-*, anthropic-dangerous-direct-browser-access, ...): the origin and the
    API key are what guard the server, not header names."""
    asked = header(scope, b"access-control-request-headers")
    allowed = _DEFAULT_ALLOWED_HEADERS
    if asked is not None and len(asked) <= _HEADER_LIST_MAX and _HEADER_LIST.match(asked.strip()):
        allowed = asked.strip().lower()
    await send(
        {
            "type": "http.response.start",
            "status": 204,
            "headers": [
                (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", allowed),
                (b"access-control-max-age", b"600"),
                (b"vary", b"access-control-request-headers"),
                (b"content-length", b"0"),
            ],
            "trailers": False,
        }
    )
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def retry_after_headers(seconds: float) -> Headers:
    """`Retry-After` in whole seconds (rounded up, at least 1: what most clients read)
    and `retry-after-ms` (what the OpenAI SDKs prefer when present), within the
    documented range (the scheduler's estimates already are; a long drain may not be)."""
    seconds = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, seconds))
    return [
        (b"retry-after", str(max(1, math.ceil(seconds))).encode()),
        (b"retry-after-ms", str(max(1, round(seconds * 1000))).encode()),
    ]


def refusal_headers(err: ApiError, dialect: Dialect, request_id: str) -> Headers:
    headers: Headers = [(dialect.request_id_header, request_id.encode())]
    if err.retry_after is not None:
        headers.extend(retry_after_headers(err.retry_after))
    if err.retry_token is not None:
        headers.append((b"ninfer-retry-token", err.retry_token.encode()))
    if err.allow:
        headers.append((b"allow", ", ".join(err.allow).encode()))
    if err.kind in ("payload_too_large", "request_timeout", "bad_request"):
        headers.append((b"connection", b"close"))
    return headers


async def send_refusal(
    exchange: Exchange,
    scope: HTTPScope,
    dialect: Dialect,
    err: ApiError,
    request_id: str,
    *,
    max_request_bytes: int,
) -> None:
    """Answer a refusal in the route's dialect: the one place a refusal reaches the wire.
    An unread body is drained first (bounded), so the answer is not lost to a reset; an
    oversized one after the answer (a lingering close)."""
    body = dialect.error_body(err, request_id)
    status, headers = dialect.status(err), refusal_headers(err, dialect, request_id)
    draining = not exchange.body_done and worth_draining(scope, err.kind)
    if draining and err.kind == "payload_too_large":
        # The whole 413 first, then the rest of the upload read and dropped while the
        # response is held open, then the end: a client that writes its whole body
        # before reading gets its answer instead of a reset (nginx's lingering close).
        await exchange.send(_start(status, body, headers))
        await exchange.send({"type": "http.response.body", "body": body, "more_body": True})
        await discard_body(exchange.receive, LINGER_BYTES, LINGER_S)
        await exchange.send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if draining:
        await discard_body(exchange.receive, max_request_bytes, DISCARD_BODY_S)
    await send_bytes(exchange.send, status, body, headers)
