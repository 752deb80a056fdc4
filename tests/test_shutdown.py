"""SIGTERM under load drains: running and queued requests finish, new ones are refused,
exit 0, log complete."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx
import orjson
import trio
from server import stalled_stream, start_process, until_ready, validate_log

HANG_GUARD_S = 120


# The console's one format: local time, level, then the event (Hypercorn's lines too).
CONSOLE_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[(info|warning|error) *\] \S")


async def test_sigterm_drains_in_a_subprocess(tiny_gguf: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", str(tiny_gguf), "--port", "0",
        "--request-log-jsonl", str(log), "--graceful-timeout-s", "20", "--threads", "1",
        "--max-concurrency", "2", "--max-pending-requests", "8",
    ]  # fmt: skip
    console = bytearray()
    with trio.fail_after(HANG_GUARD_S):
        proc, url = await start_process(cmd, console)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await until_ready(c)
            results: list[tuple[int, str]] = []
            first_tokens = trio.Semaphore(0)

            async def in_flight(i: int) -> None:
                body = {"prompt": "x", "max_new_tokens": 200, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/generate", json=body) as r:
                    seen = False
                    text = ""
                    async for line in r.aiter_lines():
                        text += line + "\n"
                        if line.startswith("data:") and not seen:
                            seen = True
                            first_tokens.release()
                    results.append((r.status_code, text))

            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(in_flight, i)
                for _ in range(2):
                    await first_tokens.acquire()
                # Two decode, four wait in the queue (seen through /metrics).
                while "ninfer_num_requests_waiting 4.0" not in (await c.get("/metrics")).text:  # noqa: ASYNC110
                    await trio.sleep(0.02)
                async with httpx.AsyncClient(base_url=url, timeout=60) as other:
                    assert (await other.get("/health")).status_code == 200  # keep-alive
                    os.kill(proc.pid, signal.SIGTERM)
                    # During the drain a new request is refused: 503 shutting_down on a
                    # connection still open, or no connection at all once listening stops.
                    # The signal reaches the server asynchronously: wait until it says
                    # it is draining (/ready turns 503), or stops answering.
                    try:
                        while (await other.get("/ready")).status_code == 200:  # noqa: ASYNC110
                            await trio.sleep(0.02)
                        late = await other.post("/v1/generate", json={"prompt": "x"})
                    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                        pass
                    else:
                        assert late.status_code == 503
                        assert late.json()["error"]["type"] == "shutting_down"
        assert proc.stderr is not None
        while chunk := await proc.stderr.receive_some():
            console += chunk
        code = await proc.wait()
    assert code == 0
    lines = console.decode().splitlines()
    assert [line for line in lines if not CONSOLE_LINE.match(line)] == []
    ready = [line for line in lines if " ready " in line]
    assert len(ready) == 1
    assert "load_s=" in ready[0]
    assert "since_start_s=" in ready[0]
    # load_s counts all that ready waited for: reading the file and the self-check too.
    load_s = float(re.search(r"load_s=([0-9.]+)", ready[0])[1])  # type: ignore[index]
    read_s = float(next(re.search(r" in ([0-9.]+)s$", line)[1]  # type: ignore[index]
                        for line in lines if " loaded " in line))  # fmt: skip
    check_s = float(next(re.search(r"seconds=([0-9.]+)", line)[1]  # type: ignore[index]
                         for line in lines if " self_check " in line))  # fmt: skip
    assert load_s + 0.06 >= read_s + check_s, (load_s, read_s, check_s)
    listening = next(i for i, line in enumerate(lines) if "listening on http://" in line)
    assert listening < lines.index(ready[0])  # the port opens first, and says so
    assert [s for s, _ in results] == [200] * 6
    assert all("event: done" in text for _, text in results)
    records = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    events = [r["event"] for r in records]
    assert events.count("request_done") == 6
    starts = {r["request_id"] for r in records if r["event"] == "request_start"}
    ends = [r["request_id"] for r in records if r["event"] == "request_done"]
    assert sorted(ends) == sorted(starts)
    assert events[-1] == "server_stop"
    validate_log(log)


async def test_a_stalled_reader_cannot_hold_the_shutdown_hostage(tmp_path: Path) -> None:
    """SIGINT (drained as SIGTERM is) with one client that stopped reading a stream and
    one still reading a long one: the process exits while the stalled client still
    holds its socket (within --graceful-timeout-s + --write-timeout-s + a few seconds),
    the reading stream ends with its protocol's error event, and every request has
    exactly one terminal record before server_stop."""
    from tinymodel import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "long.gguf", context=4096)
    log = tmp_path / "requests.jsonl"
    cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", str(model), "--port", "0",
        "--request-log-jsonl", str(log), "--graceful-timeout-s", "1",
        "--write-timeout-s", "3", "--threads", "1",
    ]  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        proc, url = await start_process(cmd)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await until_ready(c)
            stalled = await stalled_stream(url, "stalled")
            reading: list[str] = []
            started = trio.Event()

            async def reader() -> None:
                body = {"prompt": "x", "max_new_tokens": 3500, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                headers = {"x-request-id": "reader"}
                async with c.stream("POST", "/v1/generate", json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        reading.append(line)
                        started.set()

            async with trio.open_nursery() as n:
                n.start_soon(reader)
                await started.wait()
                os.kill(proc.pid, signal.SIGINT)
            code = await proc.wait()  # the stalled client still holds its socket
        stalled.close()
    assert code == 0
    assert "event: error" in reading
    assert any("shutting_down" in line for line in reading)
    records = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    starts = [r["request_id"] for r in records if r["event"] == "request_start"]
    terminal = {
        "request_done", "request_rejected", "request_cancelled", "request_error",
    }  # fmt: skip
    ends = [r["request_id"] for r in records if r["event"] in terminal]
    assert sorted(starts) == sorted(ends) == ["reader", "stalled"]
    by_id = {r["request_id"]: r for r in records if r["event"] in terminal}
    assert (by_id["reader"]["event"], by_id["reader"]["cause"]) == ("request_cancelled", "shutdown")
    assert by_id["stalled"]["event"] == "request_cancelled"
    assert records[-1]["event"] == "server_stop"
    validate_log(log)
