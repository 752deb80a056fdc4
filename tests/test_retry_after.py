"""Retry-After's promises against a real server (tiny model): a client told to come back
is let in, and a token holds its place against a poller. Each verdict is on who gets
in, never on how close a told wait came to a wall-clock wait (that depends on the
machine's pace while the test runs): the told waits are checked against the moments
places come back on Trio's autojump clock (tests/test_flow.py,
`test_retry_after_is_when_the_place_really_comes_back`), and
`benchmarks/retry_after.py` measures their error under closed-loop overload on the
real model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio
from server import serve

GEN = "/v1/generate"


async def test_a_client_told_to_come_back_is_let_in(tiny_gguf: Path, tmp_path: Path) -> None:
    """One place. A client refused while it is taken is promised it; when the place
    comes back, a newcomer (one that says it is a first attempt, as the OpenAI and
    Anthropic SDKs do with `x-stainless-retry-count: 0`, so that the test does not hang
    on timing) re-sending the moment its own request ended is refused, and the refused
    client, back at the time it was told, gets in. Before promises were places held,
    the newcomer took the place and the refused client was refused again and again.

    Requests are sized like the held one (the first request is the same), so the
    newcomer cannot backfill the held place whatever the machine's pace: backfilling
    needs the promise due later than 1.2 times such a request plus 0.5 s, and it is due
    at most one such request from when the place comes back. (With a 2-token first
    request the newcomer was taken for a short one and backfilled on a loaded CI
    machine, as designed.)"""
    settings = {"max_concurrency": 1, "max_pending_requests": 0, "pending_timeout_ms": 600_000}
    long = {"prompt": "held", "max_new_tokens": 60, "ignore_eos": True}
    short = {"prompt": "back", "max_new_tokens": 2}
    async with serve(tiny_gguf, tmp_path, **settings) as srv, srv.client() as c:
        r = await c.post(GEN, json=long)  # the engine measures its pace, requests' size
        assert r.status_code == 200
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        while sched.statistics().in_system:  # released just after its last byte is sent
            await trio.lowlevel.checkpoint()
        first = {"x-stainless-retry-count": "0"}
        returns: list[int] = []
        async with trio.open_nursery() as n:
            held_done = trio.Event()

            async def held() -> None:
                r = await c.post(GEN, json=long, headers=first)
                assert r.status_code == 200
                held_done.set()
                # the newcomer: re-sends at once, while the refused client waits
                r = await c.post(GEN, json=short, headers=first)
                assert r.status_code == 429, "a newcomer took a promised place"

            n.start_soon(held)
            while sched.statistics().running == 0:
                await trio.lowlevel.checkpoint()
            for attempt in range(10):
                r = await c.post(GEN, json=short, headers={"x-stainless-retry-count": str(attempt)})
                if r.status_code == 200:
                    break
                assert r.status_code == 429
                returns.append(attempt)
                await trio.sleep(int(r.headers["retry-after-ms"]) / 1000)
            assert r.status_code == 200
            assert held_done.is_set()
        stats = sched.statistics()
        assert stats.promises_kept_total >= 1
    assert 1 <= len(returns) <= 3


async def test_a_token_holds_its_place_against_a_poller(tiny_gguf: Path, tmp_path: Path) -> None:
    """One place, taken. A client that speaks tokens (`ninfer-retry-token: new`) is
    refused with a token; asking again at once with it is told the rest of the same
    wait and makes no second promise; a poller that retries every few milliseconds
    without a token never gets in before it; the client, back with its token when
    told, gets in (docs/scheduler.md, "Tokens")."""
    settings = {"max_concurrency": 1, "max_pending_requests": 0, "pending_timeout_ms": 600_000}
    long = {"prompt": "held", "max_new_tokens": 60, "ignore_eos": True}
    short = {"prompt": "back", "max_new_tokens": 2}
    async with serve(tiny_gguf, tmp_path, **settings) as srv, srv.client() as c:
        assert (await c.post(GEN, json=long)).status_code == 200  # the engine's pace
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        while sched.statistics().in_system:
            await trio.lowlevel.checkpoint()
        order: list[str] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                n.start_soon(functools.partial(c.post, GEN, json=long))
                while sched.statistics().running == 0:
                    await trio.lowlevel.checkpoint()
                r = await c.post(GEN, json=short, headers={"ninfer-retry-token": "new"})
                assert r.status_code == 429, r.text
                token = r.headers["ninfer-retry-token"]
                again = await c.post(GEN, json=short, headers={"ninfer-retry-token": token})
                assert again.status_code == 429
                assert again.headers["ninfer-retry-token"] == token
                assert int(again.headers["retry-after-ms"]) <= int(r.headers["retry-after-ms"])
                assert sched.statistics().promised == 1
                done = trio.Event()
                n.start_soon(
                    _poll, c, short, done, order, lambda _k: {"x-stainless-retry-count": "1"}
                )
                for _ in range(10):
                    await trio.sleep(int(r.headers["retry-after-ms"]) / 1000)
                    r = await c.post(GEN, json=short, headers={"ninfer-retry-token": token})
                    if r.status_code == 200:
                        order.append("token")
                        break
                    assert r.headers["ninfer-retry-token"] == token
                done.set()
    assert order[:1] == ["token"], order


async def test_a_client_known_by_its_address_holds_its_place_against_a_poller(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """One place, taken. Two clients that send no token, each from its own address: the
    one at 127.0.0.2 is refused and promised the place; the poller at 127.0.0.3
    retries every few milliseconds (as an SDK's retry, then saying nothing) and is
    told the rest of its own wait, one promise however often it asks; it never gets
    in before the client at 127.0.0.2, which gets in when it comes back as told
    (docs/scheduler.md, "Clients")."""
    settings = {"max_concurrency": 1, "max_pending_requests": 0, "pending_timeout_ms": 600_000}
    long = {"prompt": "held", "max_new_tokens": 60, "ignore_eos": True}
    short = {"prompt": "back", "max_new_tokens": 2}

    def at(srv: Any, address: str) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(local_address=address)
        return httpx.AsyncClient(base_url=srv.url, transport=transport, timeout=60)

    async with serve(tiny_gguf, tmp_path, **settings) as srv, srv.client() as c:
        assert (await c.post(GEN, json=long)).status_code == 200  # the engine's pace
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        while sched.statistics().in_system:
            await trio.lowlevel.checkpoint()
        order: list[str] = []
        client, polling = at(srv, "127.0.0.2"), at(srv, "127.0.0.3")
        async with client, polling, trio.open_nursery() as n:
            n.start_soon(functools.partial(c.post, GEN, json=long))
            while sched.statistics().running == 0:
                await trio.lowlevel.checkpoint()
            r = await client.post(GEN, json=short)
            assert r.status_code == 429, r.text
            done = trio.Event()
            polls: list[int] = []
            retry = {"x-stainless-retry-count": "1"}
            n.start_soon(
                _poll, polling, short, done, order, lambda k: retry if k % 2 else {}, polls
            )
            for _ in range(10):
                await trio.sleep(int(r.headers["retry-after-ms"]) / 1000)
                r = await client.post(GEN, json=short)
                if r.status_code == 200:
                    order.append("client")
                    break
            done.set()
        assert len(polls) > 2
        assert sched.statistics().promised <= 1  # the poller's one (or none left)
    assert order[:1] == ["client"], order


async def _poll(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    done: trio.Event,
    order: list[str],
    headers: Callable[[int], dict[str, str]],
    polls: list[int] | None = None,
) -> None:
    """A poller: `body` every few milliseconds (the k-th poll with `headers(k)`) until it
    gets in (it says so in `order`) or `done` is set; each answer's status in `polls`."""
    polls = [] if polls is None else polls
    while not done.is_set():
        p = await http.post(GEN, json=body, headers=headers(len(polls)))
        polls.append(p.status_code)
        if p.status_code == 200:
            order.append("poller")
            return
        await trio.sleep(0.005)


def test_one_slow_step_does_not_move_the_pace() -> None:
    """The pace Retry-After is told from is the median of the recent decode steps: a
    step held up 50x (a collection, a thread off its core) leaves it where it was,
    where a moving average multiplied it (the test above once failed on it: a client
    told 2.2 s for a place back in 0.25 s)."""
    from ninfer.engine._engine import PACE_STEPS, StepPace

    pace = StepPace()
    assert pace.seconds() == 0.0
    for _ in range(PACE_STEPS - 1):
        pace.add(0.001)
    pace.add(0.05)
    assert pace.seconds() == 0.001
    for _ in range(PACE_STEPS):  # a slower pace that lasts is taken up
        pace.add(0.004)
    assert pace.seconds() == 0.004
