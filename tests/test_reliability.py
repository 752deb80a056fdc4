"""Overload, disconnects at random moments, and clients that stop reading, on real servers.

Every loop here is bounded in count, and every test in time (the `serve` hang guard).
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from server import Server, serve, stalled_stream
from tinymodel import write_tiny_gguf

GEN = "/v1/generate"
CHAT = "/v1/chat/completions"
TERMINAL = {"request_done", "request_rejected", "request_error", "request_cancelled"}


@pytest.fixture(scope="module")
def long_context_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("long") / "long.gguf", context=4096)


def _terminal_by_id(srv: Server) -> dict[str, list[dict[str, Any]]]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for rec in srv.log_records():
        if rec["event"] in TERMINAL:
            by_id.setdefault(rec["request_id"], []).append(rec)
    return by_id


async def _settled(srv: Server) -> None:
    """Wait until nothing is held: no ticket in the scheduler, no request or page in the
    engine. The engine thread frees pages at its next step: there is no event to wait on."""
    sched = srv.app.lifespan.scheduler
    assert sched is not None
    while True:
        eng = srv.app.lifespan.service.statistics()
        assert eng is not None
        s = sched.statistics()
        if (
            s.in_system == 0
            and s.units_used == 0
            and eng.pages_used == 0
            and eng.waiting + eng.prefilling + eng.decoding == 0
        ):
            return
        await trio.sleep(0.005)


async def test_overload_every_request_answered_and_logged_once(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """Twelve times more clients than places, for a bounded number of rounds."""
    timeout_ms = 250
    async with (
        serve(
            tiny_gguf,
            tmp_path,
            max_concurrency=2,
            max_pending_requests=3,
            pending_timeout_ms=timeout_ms,
        ) as srv,
        srv.client(limits=httpx.Limits(max_connections=80)) as c,
    ):
        seen: dict[str, tuple[int, str | None]] = {}

        async def client(k: int) -> None:
            for round_ in range(3):
                rid = f"ovl-{k}-{round_}"
                body: dict[str, Any] = {"max_new_tokens": 24, "ignore_eos": True}
                if k % 3 == 0:
                    body.update(prompt="x y", stream=True)
                    async with c.stream("POST", GEN, json=body, headers={"x-request-id": rid}) as r:
                        text = (await r.aread()).decode()
                        if r.status_code == 200:
                            assert "event: done" in text
                elif k % 3 == 1:
                    body.update(prompt="x y")
                    r = await c.post(GEN, json=body, headers={"x-request-id": rid})
                else:
                    r = await c.post(
                        CHAT,
                        json={
                            "model": srv.app.lifespan.public_id,
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 24,
                            "ignore_eos": True,
                        },
                        headers={"x-request-id": rid},
                    )
                seen[rid] = (r.status_code, r.headers.get("retry-after"))

        async with trio.open_nursery() as clients:
            for k in range(60):
                clients.start_soon(client, k)
        await _settled(srv)
    statuses = Counter(s for s, _ in seen.values())
    assert len(seen) == 180
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses[200] > 0
    assert statuses[429] > 0
    for status, retry in seen.values():
        if status != 200:
            assert retry is not None
            assert 1 <= int(retry) <= 60
    by_id = _terminal_by_id(srv)
    assert set(by_id) == set(seen)
    assert [rid for rid, recs in by_id.items() if len(recs) != 1] == []
    for rid, (status, _) in seen.items():
        rec = by_id[rid][0]
        if status == 200:
            assert rec["event"] == "request_done"
        else:
            assert (rec["event"], rec["status"]) == ("request_rejected", status)
        if status == 503:
            assert rec["type"] == "request_queue_timeout"
            # The deadline is absolute from arrival: never refused before it. How soon
            # after it is a matter of the machine's speed (a bound here failed under
            # load); test_flow proves the deadline exact on the virtual clock.
            assert rec["elapsed_seconds"] >= timeout_ms / 1000


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll state another thread changes (the engine's): there is no event to wait on."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.005)


async def _abandon_while_sending_body(url: str, rid: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: " + rid.encode() + b"\r\ncontent-length: 1000\r\n\r\n"
            b'{"prompt": "x'
        )


async def test_random_disconnects_leave_nothing_behind(
    long_context_gguf: Path, tmp_path: Path
) -> None:
    """220 clients leave at random moments: while sending the body, while queued, in
    prefill, in decode, mid-stream. Afterwards nothing is held, and a full burst fits."""
    rng = random.Random(5)
    concurrency, pending = 3, 60
    async with (
        serve(
            long_context_gguf,
            tmp_path,
            max_concurrency=concurrency,
            max_pending_requests=pending,
            pending_timeout_ms=30_000,
        ) as srv,
        srv.client(limits=httpx.Limits(max_connections=100)) as c,
    ):
        kinds: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        long_prompt = " ".join(["x y"] * 150)  # a prefill of a few chunks

        async def leaver(i: int) -> None:
            kind = rng.choice(["body", "timed", "timed", "stream", "prefill"])
            kinds[kind] += 1
            rid = f"gone-{i}"
            hdr = {"x-request-id": rid}
            if kind == "body":
                await _abandon_while_sending_body(srv.url, rid)
                return
            if kind == "stream":
                events = rng.randint(0, 6)
                body = {"prompt": "x", "max_new_tokens": 3000, "stream": True, "ignore_eos": True}
                async with c.stream("POST", GEN, json=body, headers=hdr) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            seen += 1
                            if seen > events:
                                break
                outcomes[str(r.status_code)] += 1
                return
            prompt = long_prompt if kind == "prefill" else "x"
            # Leave after a random delay: queued, prefilling or decoding, as it falls.
            with trio.move_on_after(rng.uniform(0.0, 0.25)):
                r = await c.post(
                    GEN,
                    json={"prompt": prompt, "max_new_tokens": 3000, "ignore_eos": True},
                    headers=hdr,
                )
                outcomes[str(r.status_code)] += 1
                return
            outcomes["left"] += 1

        limiter = trio.Semaphore(40)

        async def bounded(i: int) -> None:
            async with limiter:
                await leaver(i)

        async with trio.open_nursery() as n:
            for i in range(220):
                n.start_soon(bounded, i)
        with trio.fail_after(60):
            await _settled(srv)
        # Every place is free again: a burst of exactly the capacity is served, no 429.
        burst: list[int] = []

        async def one() -> None:
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 4})
            burst.append(r.status_code)

        async with trio.open_nursery() as n:
            for _ in range(concurrency + pending):
                n.start_soon(one)
        assert burst == [200] * (concurrency + pending)
    assert sum(kinds.values()) == 220
    by_id = _terminal_by_id(srv)
    assert [rid for rid, recs in by_id.items() if len(recs) != 1] == []
    assert not [r for recs in by_id.values() for r in recs if r["event"] == "request_error"]
    stages = Counter(
        recs[0]["stage"] for recs in by_id.values() if recs[0]["event"] == "request_cancelled"
    )
    # Clients really did leave at every stage.
    assert stages["body"] > 0
    assert stages["decode"] + stages["prefill"] > 0
    print(f"disconnects: {dict(kinds)} client kinds; server stages {dict(stages)}; {outcomes}")
    # Every leaver the server saw (a client may leave before its request is whole enough
    # to reach the app: how many do depends on the machine's speed) was cancelled: none
    # could finish 3000 tokens, and none is left without its one record.
    leavers = {rid: recs[0] for rid, recs in by_id.items() if rid.startswith("gone-")}
    assert leavers, "no leaver reached the server"
    assert {r["event"] for r in leavers.values()} == {"request_cancelled"}, Counter(
        r["event"] for r in leavers.values()
    )


async def test_a_client_that_stops_reading_does_not_stall_others(
    long_context_gguf: Path, tmp_path: Path
) -> None:
    """With a long write timeout the stalled stream keeps its slot, and the other
    requests are decoded and answered all the same: the engine never waits on a client."""
    async with (
        serve(long_context_gguf, tmp_path, max_concurrency=2, write_timeout_s=60.0) as srv,
        srv.client() as c,
    ):
        sock = await stalled_stream(srv.url, "stalled")
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        await _until(lambda: sched.statistics().running > 0)
        answered = []
        for _ in range(4):
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 64, "ignore_eos": True})
            answered.append((r.status_code, r.json()["usage"]["completion_tokens"]))
        assert answered == [(200, 64)] * 4
        # Once its buffers are full and 64 events wait unread, the stalled stream is left
        # out of decode steps: the others' steps compute their own rows only.
        await _until(lambda: srv.app.lifespan.service.paused_requests() == 1)
        engine = srv.app.lifespan.service
        assert engine is not None
        before = engine.statistics()
        for _ in range(3):
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 32, "ignore_eos": True})
            assert r.status_code == 200
        after = engine.statistics()
        steps = after.decode_steps - before.decode_steps
        assert steps >= 3 * 31
        assert after.decode_rows - before.decode_rows == steps, "one row a step: its own"
        # The last answer's slot is released just after its last byte; then only the
        # stalled stream is left, holding its slot.
        await _until(lambda: sched.statistics().running <= 1)
        assert sched.statistics().running == 1, "the stalled stream still holds its slot"
        sock.close()
        await _settled(srv)


async def test_a_client_that_stops_reading_loses_its_slot(
    long_context_gguf: Path, tmp_path: Path
) -> None:
    async with (
        serve(
            long_context_gguf,
            tmp_path,
            max_concurrency=1,
            max_pending_requests=0,
            write_timeout_s=0.5,
        ) as srv,
        srv.client() as c,
    ):
        sock = await stalled_stream(srv.url, "stalled")
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        await _until(lambda: sched.statistics().running > 0)
        # The buffers fill, one write waits 0.5 s, and the request is cancelled.
        await _settled(srv)
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 4})
        assert r.status_code == 200  # the only slot is free again
        # Let go visibly while the client is still connected: the record is written
        # and the server closes the connection (the client, reading at last, gets its
        # buffered bytes, then the end, or a reset). Before, both waited for the client
        # to leave.
        await _until(lambda: "stalled" in _terminal_by_id(srv))
        with contextlib.suppress(ConnectionResetError):
            while await sock.recv(65536):
                pass
        sock.close()
    (rec,) = _terminal_by_id(srv)["stalled"]
    assert (rec["event"], rec["stage"]) == ("request_cancelled", "write_stalled")
