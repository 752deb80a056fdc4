"""The life of a connection after a generation, on a real server over raw sockets.

`Connection: close` and HTTP/1.0 are honoured after a generation answer, and a
keep-alive connection left idle is closed at the keep-alive timeout: the server
closes each (the client reads its end of file), and the process's open descriptors
come back to where they were. (v0.1's disconnect watcher cancelled Hypercorn's own
close inside the final send: 400 such requests left 400 descriptors open.)
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import trio
from server import SERVER_HANG_GUARD_S, serve

GEN = "/v1/generate"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _exchange(port: int, request: bytes) -> bytes:
    """Send one raw request and read until the server closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    return bytes(data)


def _request(version: str, headers: str, stream: bool) -> bytes:
    body = orjson.dumps({"prompt": "x", "max_new_tokens": 2, "stream": stream})
    return (
        f"POST {GEN} HTTP/{version}\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_connections_are_closed_after_generations(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, keep_alive_timeout=1.0) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        # one generation first: lazily opened files and threads are not leaks
        await _exchange(port, _request("1.1", "Connection: close\r\n", stream=False))
        before = _open_fds()
        with trio.fail_after(SERVER_HANG_GUARD_S):
            for version, headers in (("1.1", "Connection: close\r\n"), ("1.0", "")):
                for stream in (False, True):
                    for _ in range(20):
                        answer = await _exchange(port, _request(version, headers, stream))
                        assert answer.split(b" ", 2)[1] == b"200", answer[:80]
            # kept alive, then left idle: closed at the keep-alive timeout
            for stream in (False, True):
                answer = await _exchange(port, _request("1.1", "", stream))
                assert answer.split(b" ", 2)[1] == b"200", answer[:80]
            # The server's ends close just after ours: nothing to wait on but the count.
            while _open_fds() > before:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert _open_fds() == before


async def test_two_framings_are_refused_and_the_connection_closed(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """Content-Length with Transfer-Encoding (request smuggling): 400 `bad_request`, and
    the server closes the connection instead of reading what follows as a request. (A
    request pipelined behind it in the same packet is never served either; Hypercorn
    then closes before the 400 is written.)"""
    async with serve(tiny_gguf, tmp_path) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        body = b'{"prompt": "x", "max_new_tokens": 1}'
        request = (
            b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        )  # fmt: skip
        smuggled = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
        with trio.fail_after(SERVER_HANG_GUARD_S):
            answer = await _exchange(port, request)  # reads until the server closes
            pipelined = await _exchange(port, request + smuggled)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"400"
        assert b"connection: close" in head.lower()
        assert orjson.loads(payload)["error"]["type"] == "bad_request"
        assert b" 200 " not in pipelined, "the smuggled request was served"
    rejected = [r for r in srv.log_records() if r["event"] == "request_rejected"]
    assert rejected
    assert {(r["status"], r["type"], r["phase"]) for r in rejected} == {
        (400, "bad_request", "route")
    }


async def test_status_lines_carry_their_reason_phrase(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with trio.fail_after(SERVER_HANG_GUARD_S):
            ok = await _exchange(port, _request("1.1", "Connection: close\r\n", stream=True))
            missing = await _exchange(
                port, b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )
    assert ok.split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK"
    assert missing.split(b"\r\n", 1)[0] == b"HTTP/1.1 404 Not Found"


async def test_a_websocket_upgrade_gets_a_clean_refusal(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        request = (
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        with trio.fail_after(SERVER_HANG_GUARD_S):
            answer = await _exchange(port, request)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"400"
        error = orjson.loads(payload)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "bad_request")


async def test_an_oversized_body_written_whole_still_gets_its_413(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """A client that writes a body eight times over the limit before it reads gets the
    413, not a connection reset: the server answers, then keeps reading and discarding
    (bounded) until the body has ended, as nginx's lingering close does."""
    async with serve(tiny_gguf, tmp_path, max_request_mib=1) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        size = 8 << 20
        head = (
            f"POST {GEN} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n"
        ).encode()
        with trio.fail_after(SERVER_HANG_GUARD_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(head)
                chunk = b" " * (256 << 10)
                for _ in range(size // len(chunk)):
                    await stream.send_all(chunk)
                answer = bytearray()
                while data := await stream.receive_some(65536):
                    answer += data
        status = bytes(answer).split(b" ", 2)[1]
        assert status == b"413", bytes(answer[:200])
        assert b"payload_too_large" in answer
