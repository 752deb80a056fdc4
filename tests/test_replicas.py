"""Two ninfer replicas behind Debian's nginx, with the shipped deploy/nginx.conf: a
refusal by one replica is served by the other, streams pass through unbuffered, a
replica's SIGTERM loses nothing, and the replicas' request logs with nginx's access log
account for every request. Skipped where nginx is not installed (`.ci/run` installs it).
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from nginxlb import NGINX, Balanced, balanced

HANG_GUARD_S = 300
PENDING = 2  # each replica: 1 running + 2 waiting

pytestmark = [
    pytest.mark.nginx,
    pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx (.ci/run installs it)"),
]


def _records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def _metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url) as c:
        for line in (await c.get("/metrics")).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def _complete(c: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, bool]:
    """A streamed chat completion: its status, and whether the stream ended properly."""
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, False
        lines = [line async for line in r.aiter_lines()]
    finished = any('"finish_reason":"' in line for line in lines)
    return 200, finished and lines[-2:] == ["data: [DONE]", ""] and not any(
        line.startswith('data: {"error"') for line in lines
    )


async def test_two_replicas_behind_nginx(tiny_gguf: Path, tmp_path: Path) -> None:
    settings = {"max_concurrency": 1, "max_pending_requests": PENDING, "threads": 1,
                "graceful_timeout_s": 60, "served_model_name": "m"}  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        with balanced(tiny_gguf, tmp_path, 2, **settings) as lb:
            await _stream_passes_unbuffered(lb)
            await _refusal_served_by_the_other(lb)
            await _sigterm_loses_nothing(lb)
        _every_request_accounted_for(lb)


async def _refusal_served_by_the_other(lb: Balanced) -> None:
    """Replica 0 full with requests of its own (one running, the rest waiting): nginx's
    requests that meet it first get 429 there, and are answered by replica 1 (nginx's log
    shows both attempts)."""
    long = {"model": "m", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "hold"}]}  # fmt: skip
    busy = lb.replicas[0]

    async def hold(i: int, direct: httpx.AsyncClient, release: trio.Event) -> None:
        headers = {"x-request-id": f"direct-hold-{i}"}
        async with direct.stream("POST", "/v1/chat/completions", json=long, headers=headers):
            await release.wait()

    release = trio.Event()
    async with (
        httpx.AsyncClient(base_url=busy.url, timeout=120) as direct,
        trio.open_nursery() as n,
    ):
        for i in range(1 + PENDING):
            n.start_soon(hold, i, direct, release)
        # Another process's state: no event to wait on.
        while await _metric(busy.url, "ninfer_num_requests_waiting") < PENDING:  # noqa: ASYNC110
            await trio.sleep(0.02)
        async with httpx.AsyncClient(base_url=lb.url, timeout=120) as c:
            short = {"model": "m", "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            for _ in range(4):
                answer = await c.post("/v1/chat/completions", json=short)
                assert answer.status_code == 200, answer.text
        release.set()
    retried = [a for a in lb.access() if a.upstream_statuses == ["429", "200"]]
    assert retried, "no request met the full replica first"
    assert all(a.upstreams[0] == f"127.0.0.1:{busy.port}" for a in retried)


async def _stream_passes_unbuffered(lb: Balanced) -> None:
    """The first token reaches the client while the replica is still generating."""
    body = {"model": "m", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "stream"}]}  # fmt: skip

    async def running() -> float:
        return sum([await _metric(r.url, "ninfer_num_requests_running") for r in lb.replicas])

    assert await running() == 0  # the first step: nothing has run yet
    async with (
        httpx.AsyncClient(base_url=lb.url, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        at_first_token = None
        # Read to the end (leaving the loop early would close the stream).
        async for line in r.aiter_lines():
            token = '"content":"' in line and '"content":""' not in line  # not the role chunk
            if token and at_first_token is None:
                at_first_token = await running()
        assert at_first_token == 1, "the first token arrived only after the last"


CLIENTS = 2  # fewer than one replica holds: the survivor serves them all


async def _sigterm_loses_nothing(lb: Balanced) -> None:
    """Clients in a loop through nginx; replica 0 gets SIGTERM mid-run: its requests
    finish, nginx moves the next ones to replica 1 (a 503 while it drains, no
    connection once it is gone), and every request is answered whole. (Overload on top
    of a replica that is gone is benchmarks/replicas.py's: see docs/deploy.md.)"""
    body = {"model": "m", "max_tokens": 24, "ignore_eos": True,
            "messages": [{"role": "user", "content": "load"}]}  # fmt: skip
    outcomes: Counter[str] = Counter()
    done = 0
    term_sent = trio.Event()
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=lb.url, timeout=120, limits=limits) as c:

        async def client() -> None:
            nonlocal done
            for _ in range(6):
                status, whole = await _complete(c, body)
                outcomes["ok" if whole else str(status) if status != 200 else "lost"] += 1
                done += 1
                if done == 3:
                    lb.replicas[0].proc.send_signal(signal.SIGTERM)
                    term_sent.set()

        async with trio.open_nursery() as n:
            for _ in range(CLIENTS):
                n.start_soon(client)
    assert term_sent.is_set()
    assert lb.replicas[0].proc.wait(120) == 0
    # The survivor alone holds as many as there are clients: every request is answered.
    assert outcomes == {"ok": CLIENTS * 6}, outcomes


def _every_request_accounted_for(lb: Balanced) -> None:
    """Every attempt nginx logged has its record on the replica it reached, under the
    request id nginx logged: an answer (request_done; request_cancelled would be a
    stream its client closed early), or the refusal with the status nginx saw; and
    every generation a replica logged is in nginx's log (but the one sent directly)."""
    records: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in lb.replicas:
        for rec in _records(r.log):
            if rec["event"] in ("request_done", "request_cancelled", "request_rejected"):
                records.setdefault((f"127.0.0.1:{r.port}", rec["request_id"]), []).append(rec)
    seen: set[tuple[str, str]] = set()
    for a in lb.access():
        if not a.request.startswith("POST /v1/chat/completions"):
            continue
        assert str(a.status) == a.upstream_statuses[-1], a
        for addr, status in zip(a.upstreams, a.upstream_statuses, strict=True):
            (rec,) = records.get((addr, a.request_id), [{}])
            seen.add((addr, a.request_id))
            if status == "502":
                # nginx read no answer: the replica had stopped listening (no record),
                # or closed the connection as its 503 went out (a refusal record).
                assert rec.get("event") in (None, "request_rejected"), (a, rec)
                continue
            if status == "200":
                assert rec.get("event") in ("request_done", "request_cancelled"), (a, rec)
            else:
                assert (rec.get("event"), str(rec.get("status"))) == ("request_rejected",
                                                                      status), (a, rec)  # fmt: skip
    unlogged = [key for key in records if key not in seen and not key[1].startswith("direct")]
    assert unlogged == [], unlogged
