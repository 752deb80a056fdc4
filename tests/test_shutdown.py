"""SIGTERM under load drains: running and queued requests finish, new ones are refused,
exit 0, log complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import trio
from server import validate_log

HANG_GUARD_S = 120


async def test_sigterm_drains_in_a_subprocess(tiny_gguf: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", str(tiny_gguf), "--port", "0",
        "--request-log-jsonl", str(log), "--graceful-timeout-s", "20", "--threads", "1",
        "--max-concurrency", "2", "--max-pending-requests", "8",
    ]  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        url = None
        buf = b""
        while url is None:
            chunk = await proc.stderr.receive_some()
            assert chunk, buf.decode(errors="replace")
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if "Running on http://" in line:
                    url = line.split("Running on ")[1].split()[0]
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            # Polling another process over HTTP: there is no event to wait on.
            while (await c.get("/ready")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.05)
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
                    try:
                        late = await other.post("/v1/generate", json={"prompt": "x"})
                    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                        pass
                    else:
                        assert late.status_code == 503
                        assert late.json()["error"]["type"] == "shutting_down"
        code = await proc.wait()
    assert code == 0
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
