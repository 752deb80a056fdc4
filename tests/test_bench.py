"""`ninfer bench` against a real server: the counts it reports are the server's."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import pytest
import trio
from server import serve

from ninfer.tools._bench import (
    BenchConfig,
    check_loopback,
    plot_bench,
    render_table,
    run_bench,
    server_url,
)


@pytest.mark.parametrize("route", ["chat", "completions", "native"])
async def test_bench_closed_and_open_loop(tiny_gguf: Path, tmp_path: Path, route: str) -> None:
    async with serve(tiny_gguf, tmp_path, max_concurrency=2, max_pending_requests=2) as srv:
        cfg = BenchConfig(
            url=srv.url, route=route, clients=(1, 6), rates=(40.0,), duration_s=0.6,
            max_requests=60, max_tokens=8, warmup_s=0.2,
        )  # fmt: skip
        results = await run_bench(cfg, progress=False)
        done = [r for r in srv.log_records() if r["event"] == "request_done"]
    rows = [r.summary() for r in results]
    assert [(r["mode"], r["load"]) for r in rows] == [("closed", 1), ("closed", 6), ("open", 40)]
    for row in rows:
        assert row["failed"] == 0, row["errors"]
        assert row["ok"] > 0
        assert row["completion_tokens"] == 8 * row["ok"]
        assert row["ttft_p50"] is not None
        assert row["itl_p50"] is not None
    # Six clients on two slots and two queue places: some are refused at once.
    assert rows[1]["rejected_429"] > 0
    # Everything the bench counted as served, the server logged as done (plus warm-up).
    assert len(done) >= sum(r["ok"] for r in rows)
    assert "tok/s" in render_table(rows)
    panels = plot_bench(rows, str(tmp_path / "bench.png"), "test")
    # one quantity per axis: first-token time and whole-request time are not mixed
    assert {"time to first token", "end-to-end latency", "inter-token latency"} <= set(panels)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_stays_on_loopback_unless_asked() -> None:
    check_loopback("http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("http://10.0.0.5:8080")
    # `ninfer bench localhost:8080` said " is not a loopback address" (an empty host)
    assert server_url("localhost:8080") == "http://localhost:8080"
    assert server_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    check_loopback(server_url("localhost:8080"))
    with pytest.raises(ValueError, match="names no host"):
        check_loopback("http://:8080")


class _StuckServer:
    """A server that answers each generation with its first token and then nothing: every
    request is still running when a level ends. It counts the connections its clients
    closed (the bench cancelling what it cut)."""

    def __init__(self) -> None:
        self.streams = 0
        self.closed = 0

    async def handle(self, conn: trio.SocketStream) -> None:
        request = b""
        while not request.startswith(b"POST /v1/generate"):  # a 404 to anything else
            if request:
                await conn.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            request = b""
            while b"\r\n\r\n" not in request:
                data = await conn.receive_some()
                if not data:
                    return
                request += data
        self.streams += 1
        await conn.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        event = b'data: {"token_ids": [7], "text": "a"}\n\n'
        await conn.send_all(b"%x\r\n%s\r\n" % (len(event), event))
        while await conn.receive_some():  # the body's rest, then b"" when the client goes
            pass
        self.closed += 1


async def _stuck_server(nursery: trio.Nursery) -> tuple[_StuckServer, str]:
    server = _StuckServer()
    (listener,) = await nursery.start(
        functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
    )
    return server, f"http://127.0.0.1:{listener.socket.getsockname()[1]}"


async def test_a_level_ends_after_its_duration_and_grace_cutting_what_still_runs() -> None:
    """A server that never finishes: each level still ends (duration, then grace), the
    requests still running are cut (cancelled, their connections closed), counted apart
    and not as failures, and the tokens they delivered count toward throughput."""
    with trio.fail_after(120):  # a hang guard
        async with trio.open_nursery() as n:
            server, url = await _stuck_server(n)
            cfg = BenchConfig(
                url=url, route="native", clients=(2,), rates=(20.0,), duration_s=0.3,
                grace_s=0.2, warmup_s=0, max_tokens=8,
            )  # fmt: skip
            results = await run_bench(cfg, progress=False)
            n.cancel_scope.cancel()
    closed, opened = (r.summary() for r in results)
    assert closed["requests"] == 2  # each client's first request never ended
    assert (closed["cut"], closed["ok"], closed["failed"]) == (2, 0, 0)
    assert closed["tokens_per_second"] > 0  # the first token of each
    assert opened["requests"] >= 1
    assert (opened["cut"], opened["ok"], opened["failed"]) == (opened["requests"], 0, 0)
    assert server.streams == closed["requests"] + opened["requests"]
    assert server.closed == server.streams
    for result in results:
        assert result.seconds >= cfg.duration_s + cfg.grace_s
    assert " cut" in render_table([closed, opened])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
async def test_progress_shows_from_the_first_moment(tty: bool) -> None:
    """What will run is said before the first connection, each level's line from its
    start; on a terminal a bar redrawn in place (with the requests still finishing), in
    a pipe whole lines only."""
    stream = _Terminal() if tty else io.StringIO()
    with trio.fail_after(120):  # a hang guard
        async with trio.open_nursery() as n:
            _server, url = await _stuck_server(n)
            cfg = BenchConfig(
                url=url, route="native", clients=(1,), duration_s=0.3, grace_s=1.0,
                warmup_s=0, max_tokens=8,
            )  # fmt: skip
            await run_bench(cfg, stream=stream)
            n.cancel_scope.cancel()
    text = stream.getvalue()
    first = text.split("\n", 1)[0]
    assert first == f"ninfer bench: {url} (native), 1 level of 0.3 s, at most 1.3 s"
    if tty:
        redrawn = text.split("\n")[1].split("\r")
        assert redrawn[1].startswith("[1/1] closed 1")
        assert any("finishing 1" in line for line in redrawn)
        assert redrawn[-1].endswith(", 1 cut at the end\x1b[K")
    else:
        assert "\r" not in text
        assert text.splitlines()[1:] == [
            "[1/1] closed 1: running for 0.3 s (+ up to 1 s to finish)",
            text.splitlines()[2],
        ]
        assert text.splitlines()[2].startswith("[1/1] closed 1: 0 requests done in ")
        assert text.splitlines()[2].endswith(" s, 1 cut at the end")
