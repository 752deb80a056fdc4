"""The request's life, without sockets or threads.

The lifecycle's transition table is walked exhaustively (synchronously); then the
real app (routes, frontends, the request flow, the scheduler and the bridge) serves
a fake engine inside Trio on the autojump clock: disconnects at every stage,
deadlines to the exact virtual instant, overload, a reader that stops and resumes,
a reader that stalls for good, and an engine failure. Every test reads the request
log back and finds exactly one terminal record per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio.testing
from fakeengine import FAIL, AsgiClient, FakeEngine, request
from server import running_app as running
from server import wait_for as _wait_for

from ninfer._app import App
from ninfer._lifecycle import TABLE, TERMINAL, Lifecycle, LifecycleError, Stage, Trigger
from ninfer.engine import EngineTimings, Finish, Usage

TERMINAL_RECORDS = {"request_done", "request_rejected", "request_cancelled", "request_error"}
GEN = "/v1/generate"

# ---- the lifecycle, synchronously ------------------------------------------------------------

_FINISH = Finish("length", Usage(3, 2), EngineTimings(0.0, 0.0, 0.0), None)


def _fire(life: Lifecycle, trigger: Trigger) -> None:
    """Fire `trigger` through the public method that owns it."""
    if trigger is Trigger.ROUTED:
        life.routed()
    elif trigger is Trigger.BODY_READ:
        life.body_read()
    elif trigger is Trigger.PREPARED:
        life.prepared(1.0)
    elif trigger is Trigger.ADMITTED:
        life.admitted(2.0)
    elif trigger is Trigger.FIRST_TOKEN:
        life.first_token(3.0)
    elif trigger is Trigger.SETTLED:
        life.settled(_FINISH, life.timing(_FINISH.timings, 4.0), stream=False)
    elif trigger is Trigger.SENT:
        life.sent()
    elif trigger is Trigger.REFUSED:
        life.refused(5.0, status=400, kind="invalid_request", code=None, param="x")
    elif trigger is Trigger.GONE:
        life.gone(5.0)
    elif trigger is Trigger.STALLED:
        life.stalled(5.0)
    else:
        life.failed(status=500, kind="internal_error", message="boom")


def _recorder(records: list[str]) -> Any:
    def emit(event: str, *_args: Any, **_fields: Any) -> None:
        records.append(event)

    return emit


def test_every_path_writes_exactly_one_terminal_record() -> None:
    """Walk every sequence of events the table allows: a terminal record is written at
    most once along the way, and exactly once in every terminal state; an event the
    table does not allow raises and writes nothing."""
    paths: list[list[Trigger]] = [[]]
    terminal_paths = 0
    while paths:
        path = paths.pop()
        records: list[str] = []
        life = Lifecycle("r", GEN, 0.0, _recorder(records))
        for trigger in path:
            _fire(life, trigger)
        terminals = [r for r in records if r in TERMINAL_RECORDS]
        assert len(terminals) <= 1, (path, records)
        assert life.decided == (len(terminals) == 1), (path, records)
        if life.stage in TERMINAL:
            terminal_paths += 1
        for trigger in Trigger:
            if life.allows(trigger):
                paths.append([*path, trigger])
            else:
                before = (life.stage, list(records))
                with pytest.raises(LifecycleError):
                    _fire(life, trigger)
                assert (life.stage, records) == before
    # ROUTE 2 ways out, BODY/PREPARE/QUEUED 3 each, PREFILL and DECODE 3 each plus
    # 3 through RESPOND each: 2 + 9 + 12 = 23 complete lives.
    assert terminal_paths == 23


def test_the_record_names_the_stage_it_was_decided_in() -> None:
    records: list[tuple[str, dict[str, Any]]] = []
    life = Lifecycle("r", GEN, 0.0, lambda ev, _rid, **f: records.append((ev, f)))
    for trigger in (Trigger.ROUTED, Trigger.BODY_READ, Trigger.PREPARED, Trigger.ADMITTED):
        _fire(life, trigger)
    life.stalled(7.5)
    event, fields = records[-1]
    assert event == "request_cancelled"
    assert fields["stage"] == "write_stalled"
    assert fields["elapsed_seconds"] == 7.5
    assert fields["queue_seconds"] == 1.0
    assert life.stage is Stage.CANCELLED


def test_table_has_no_way_out_of_a_terminal_state() -> None:
    assert not [key for key in TABLE if key[0] in TERMINAL]
    # RESPOND's ways out write nothing: its outcome was written when it was entered.
    assert all(TABLE[key][1] is None for key in TABLE if key[0] is Stage.RESPOND)


# ---- the app over a fake engine, on the autojump clock -------------------------------------


def records(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (tmp_path / "requests.jsonl").read_bytes().splitlines()]


def terminal(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The terminal record of each request, asserting there is exactly one."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records(tmp_path):
        if rec["event"] in TERMINAL_RECORDS:
            assert rec["request_id"] not in out, f"two terminal records for {rec['request_id']}"
            out[rec["request_id"]] = rec
    return out


def _client(app: App, rid: str, path: str = GEN) -> AsgiClient:
    return AsgiClient(
        app,
        "POST",
        path,
        headers=[(b"content-type", b"application/json"), (b"x-request-id", rid.encode())],
    )


def _quiet(app: App, engine: FakeEngine) -> None:
    """Nothing is held anywhere: no ticket, no page, no engine request."""
    assert app.lifespan.scheduler is not None
    s = app.lifespan.scheduler.statistics()
    assert (s.in_system, s.running, s.waiting, s.units_used) == (0, 0, 0, 0)
    assert engine.active == 0


async def test_a_request_is_served_with_exact_stage_times(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FakeEngine(step_s=0.01, prefill_steps=3)
    async with running(tmp_path, engine) as app:
        start = trio.current_time()
        r = await request(app, "POST", GEN, {"prompt": "hi", "max_new_tokens": 4})
        assert r.status == 200
        body = r.json()
        assert body["text"] == "aaaa"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
        # three prefill steps, then four decode steps of 10 ms, on the virtual clock
        assert body["timing"]["ttft"] == pytest.approx(0.04)
        assert body["timing"]["total"] == pytest.approx(0.07)
        assert trio.current_time() - start == pytest.approx(0.07)
        _quiet(app, engine)
    recs = records(tmp_path)
    events = [r["event"] for r in recs if r["request_id"] is not None]
    assert events == ["request_start", "request_done"]


async def test_busy_intervals_print_a_stats_line(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each --log-stats-interval-ms with work: one console line (requests admitted and
    refused, running, waiting, tokens per second, KV use) and one throughput record;
    idle intervals print nothing."""
    engine = FakeEngine(step_s=0.01, prefill_steps=1)
    async with running(tmp_path, engine, log_stats_interval_ms=1000) as app:
        await trio.sleep(0.5)  # virtual: the request falls in the first interval
        r = await request(app, "POST", GEN, {"prompt": "hi", "max_new_tokens": 30})
        assert r.status == 200
        await trio.sleep(5.0)  # four idle intervals after it
        _quiet(app, engine)
    lines = [line for line in capsys.readouterr().err.splitlines() if " stats " in line]
    assert len(lines) == 1, lines
    fields = dict(part.split("=", 1) for part in lines[0].split() if "=" in part)
    assert fields == {"admitted": "1", "refused": "0", "running": "0", "waiting": "0",
                      "gen_tok_s": "30.0", "prompt_tok_s": "0.0", "kv_used": "0.0%"}  # fmt: skip
    (rec,) = [r for r in records(tmp_path) if r["event"] == "throughput"]
    assert rec["generated_tokens"] == 30
    assert rec["interval_seconds"] == 1.0


@pytest.mark.parametrize("stage", ["body", "queued", "prefill", "decode", "respond"])
async def test_a_disconnect_at_every_stage_frees_everything(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    stage: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The client leaves at `stage`: the record says where (a settled request stays
    done), the slot, the queue place and the engine row are all freed, and its access
    line says what came of it (the status, `-` where no answer began)."""
    engine = FakeEngine(step_s=0.01, prefill_steps=5)
    async with running(tmp_path, engine, max_concurrency=1, max_pending_requests=4) as app:
        async with trio.open_nursery() as n:
            blocker = _client(app, "blocker")
            if stage == "queued":  # someone holds the only slot
                blocker.send_body(b'{"prompt": "x", "max_new_tokens": 50}')
                n.start_soon(blocker.run)
                await _wait_for(lambda: engine.active == 1)
            c = _client(app, "leaver")
            body = b'{"prompt": "hello", "max_new_tokens": 20, "stream": true}'
            if stage == "respond":  # a whole answer: its one write comes after it settled
                body = b'{"prompt": "hello", "max_new_tokens": 20}'
                c.reading = trio.Event()
            if stage == "body":
                c.send_body(body[:10], more=True)
                n.start_soon(c.run)
                await trio.sleep(0.05)
                c.disconnect()
            else:
                c.send_body(body)
                n.start_soon(c.run)
                sched = app.lifespan.scheduler
                assert sched is not None
                if stage == "queued":
                    await _wait_for(lambda: sched.statistics().waiting == 1)
                elif stage == "prefill":
                    await _wait_for(lambda: engine.active == 1)
                elif stage == "decode":
                    await _wait_for(lambda: b"token" in c.response.body)
                else:  # respond: the body's write is held by a reader that paused
                    await c.started.wait()
                c.disconnect()
                if stage == "respond":
                    c.reading.set()  # what was being written completes
            await c.finished.wait()
            if stage == "queued":
                await blocker.finished.wait()
        _quiet(app, engine)
    rec = terminal(tmp_path)["leaver"]
    if stage == "respond":
        assert rec["event"] == "request_done"
    else:
        assert (rec["event"], rec["stage"]) == ("request_cancelled", stage)
        if stage in ("prefill", "decode"):
            assert engine.cancelled == ["leaver"]
    err = capsys.readouterr().err
    (access,) = [line for line in err.splitlines() if " access " in line and "=leaver " in line]
    # A stream's 200 is sent once it is admitted; before that no answer began.
    status = "200" if stage in ("prefill", "decode", "respond") else "-"
    outcome = "" if stage == "respond" else f" outcome=cancelled stage={stage}"
    assert f"route=/v1/generate status={status}{outcome} " in access


async def test_an_embedding_request_whose_client_leaves_is_cancelled(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """40 inputs go to the engine 16 at a time; the client leaves while the first 16
    are computed: those 16 are cancelled in the engine, no later input is submitted,
    the record says cancelled in prefill, and everything is free for the next request,
    which is served."""
    engine = FakeEngine(step_s=0.01, prefill_steps=5)
    body = orjson.dumps({"input": [f"text {i}" for i in range(40)]})
    async with running(tmp_path, engine, max_concurrency=1) as app:
        async with trio.open_nursery() as n:
            c = _client(app, "leaver", "/v1/embeddings")
            c.send_body(body)
            n.start_soon(c.run)
            await _wait_for(lambda: engine.active == 16)
            c.disconnect()
            await c.finished.wait()
        _quiet(app, engine)
        assert len(engine.submitted) == 16
        assert len(engine.cancelled) == 16
        r = await request(app, "POST", "/v1/embeddings", {"input": ["a", "b"]})
        assert r.status == 200
        assert [d["index"] for d in r.json()["data"]] == [0, 1]
        _quiet(app, engine)
    rec = terminal(tmp_path)["leaver"]
    assert (rec["event"], rec["stage"]) == ("request_cancelled", "prefill")
    assert rec["kind"] == "embedding"  # on the terminal record too, not only request_start


async def test_the_queue_deadline_is_exact(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Behind a long request, a queued one is refused 503 at arrival + the pending
    timeout, to the virtual microsecond, with Retry-After; it never reached the engine."""
    engine = FakeEngine(step_s=0.01)
    settings = {"max_concurrency": 1, "max_pending_requests": 2, "pending_timeout_ms": 250}
    async with running(tmp_path, engine, **settings) as app, trio.open_nursery() as n:
        long = _client(app, "long")
        long.send_body(b'{"prompt": "x", "max_new_tokens": 100}')
        n.start_soon(long.run)
        await _wait_for(lambda: engine.active == 1)
        arrival = trio.current_time()
        r = await request(app, "POST", GEN, {"prompt": "y", "max_new_tokens": 2})
        assert trio.current_time() - arrival == pytest.approx(0.25, abs=1e-6)
        assert r.status == 503
        assert r.json()["error"]["type"] == "request_queue_timeout"
        assert int(r.headers[b"retry-after"]) >= 1
        await long.finished.wait()
        assert long.response.status == 200
    (queued,) = [r for r in terminal(tmp_path).values() if r["request_id"] != "long"]
    assert (queued["event"], queued["phase"], queued["status"]) == (
        "request_rejected",
        "queued",
        503,
    )


async def test_overload_is_refused_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine, max_concurrency=1, max_pending_requests=1) as app:
        async with trio.open_nursery() as n:
            held = [_client(app, f"held{i}") for i in range(2)]
            for c in held:
                c.send_body(b'{"prompt": "x", "max_new_tokens": 30}')
                n.start_soon(c.run)
            sched = app.lifespan.scheduler
            assert sched is not None
            await _wait_for(lambda: sched.statistics().in_system == 2)
            before = trio.current_time()
            r = await request(app, "POST", "/v1/chat/completions", {"model": "x", "messages": []})
            assert trio.current_time() == before  # not a moment of waiting
            assert r.status == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert r.headers[b"retry-after"].isdigit()
        assert [c.response.status for c in held] == [200, 200]
        _quiet(app, engine)
    recs = terminal(tmp_path)
    refused = [r for r in recs.values() if r["event"] == "request_rejected"]
    assert [(r["status"], r["phase"], r["endpoint"]) for r in refused] == [
        (429, "body", "/v1/chat/completions")
    ]


async def test_a_reader_that_falls_behind_is_paused_then_resumed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A stream whose reader stops is left out of decode steps once 64 events wait
    unread, and is decoded again when the reader catches up: every token arrives."""
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine, write_timeout_s=600.0) as app:
        c = _client(app, "slow")
        c.send_body(b'{"prompt": "x", "max_new_tokens": 200, "stream": true}')
        c.reading = trio.Event()  # stops reading at once
        async with trio.open_nursery() as n:
            n.start_soon(c.run)
            await _wait_for(lambda: app.lifespan.service.paused_requests() == 1)
            steps = engine.decode_steps
            await trio.sleep(1.0)  # a hundred steps' time: none is spent on the paused row
            assert engine.decode_steps == steps
            assert engine.generated < 200
            c.reading.set()
            await c.finished.wait()
        events = c.response.events()
        assert sum(1 for name, _ in events if name == "token") == 200
        assert events[-1][0] == "done"
        assert app.lifespan.service.paused_requests() == 0
    assert terminal(tmp_path)["slow"]["event"] == "request_done"


async def test_a_reader_that_stalls_for_good_loses_its_slot(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine, write_timeout_s=2.0, max_concurrency=1) as app:
        c = _client(app, "stalled")
        c.send_body(b'{"prompt": "x", "max_new_tokens": 500, "stream": true}')
        c.reading = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(c.run)
            sched = app.lifespan.scheduler
            assert sched is not None
            await _wait_for(lambda: c.held_since is not None)
            await _wait_for(lambda: sched.statistics().in_system == 0)
            # freed when one write has waited for the write timeout (polled every 1 ms)
            assert c.held_since is not None
            assert trio.current_time() - c.held_since == pytest.approx(2.0, abs=0.0015)
            r = await request(app, "POST", GEN, {"prompt": "y", "max_new_tokens": 2})
            assert r.status == 200  # the only slot is free again
            c.reading.set()
        assert engine.active == 0
    rec = terminal(tmp_path)["stalled"]
    assert (rec["event"], rec["stage"]) == ("request_cancelled", "write_stalled")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_failure_is_one_error_record(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine) as app:
        r = await request(app, "POST", GEN, {"prompt": FAIL, "stream": stream})
        if stream:
            assert r.status == 200
            name, data = r.events()[-1]
            assert (name, data["error"]["type"]) == ("error", "internal_error")
        else:
            assert r.status == 500
            assert r.json()["error"]["type"] == "internal_error"
        _quiet(app, engine)
    (rec,) = terminal(tmp_path).values()
    assert (rec["event"], rec["status"], rec["stage"]) == ("request_error", 500, "prefill")
    assert rec["message"] == "injected failure"


async def test_one_failed_choice_fails_the_request_and_stops_the_others(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Choices decoded together (a prompt array): when one fails, the others are
    cancelled at once, nothing is held, and the request has one error record."""
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine) as app:
        body = {"model": "fake", "prompt": ["fine", FAIL], "max_tokens": 400}
        start = trio.current_time()
        r = await request(app, "POST", "/v1/completions", body)
        assert r.status == 500
        assert r.json()["error"]["type"] == "server_error"
        assert trio.current_time() - start < 0.1  # not the 4 s the other choice would take
        _quiet(app, engine)
    (rec,) = terminal(tmp_path).values()
    assert (rec["event"], rec["status"], rec["message"]) == (
        "request_error",
        500,
        "injected failure",
    )
    assert len(engine.cancelled) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (GEN, {"prompt": "hi", "max_new_tokens": 3}),
        ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3}),
        ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 3}),
        ("/v1/messages", {"model": "fake", "max_tokens": 3,
                          "messages": [{"role": "user", "content": "hi"}]}),
    ],
)  # fmt: skip
async def test_every_frontend_runs_the_same_flow(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, path: str, body: dict[str, Any]
) -> None:
    """Each frontend, whole and streamed, through the same flow: one start, one done."""
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine) as app:
        whole = await request(app, "POST", path, body)
        assert whole.status == 200, whole.body
        streamed = await request(app, "POST", path, {**body, "stream": True})
        assert streamed.status == 200
        assert streamed.headers[b"content-type"] == b"text/event-stream"
        assert streamed.events()
    recs = records(tmp_path)
    per_request = [r["event"] for r in recs if r["request_id"] is not None]
    assert per_request == ["request_start", "request_done"] * 2
    assert {r["protocol"] for r in recs if r["event"] == "request_start"} == {
        {GEN: "native", "/v1/messages": "anthropic"}.get(path, "openai")
    }


async def test_retry_after_is_when_the_place_really_comes_back(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Known output lengths (30 and 50 tokens running, 20 and 40 queued, 10 ms a step):
    places come back at 0.30, 0.50, 0.50 and 0.90 s. Six clients (six addresses) refused
    together are
    told the places in turn (plus the promise's margin), in retry-after-ms: the first
    three each within one engine step of the moment its place really came back; the
    rest no sooner (past the first places the estimate assumes each freed place is
    taken again, as under overload: benchmarks/retry_after.py measures its error on a
    real server). Refused together, told apart: no one is told an earlier moment than a
    client refused before it."""
    engine = FakeEngine(step_s=0.01, prefill_steps=0)
    settings = {"max_concurrency": 2, "max_pending_requests": 2, "pending_timeout_ms": 10_000}
    async with running(tmp_path, engine, **settings) as app, trio.open_nursery() as n:
        sched = app.lifespan.scheduler
        assert sched is not None
        for i, budget in enumerate((30, 50, 20, 40)):
            c = _client(app, f"held{i}")
            c.send_body(orjson.dumps({"prompt": "x", "max_new_tokens": budget}))
            n.start_soon(c.run)
            await _wait_for(lambda i=i: sched.statistics().in_system == i + 1)
        await _wait_for(lambda: sched.statistics().waiting == 2)
        t0 = trio.current_time()
        told = []
        for k in range(6):
            body = {"prompt": "y", "max_new_tokens": 5}
            r = await request(app, "POST", GEN, body, address=f"192.0.2.{k + 1}")
            assert r.status == 429
            told.append(int(r.headers[b"retry-after-ms"]) / 1000)
            assert int(r.headers[b"retry-after"]) == max(
                1, -(-int(r.headers[b"retry-after-ms"]) // 1000)
            )
        freed: list[float] = []
        held = sched.statistics().in_system
        while held:
            await trio.sleep(0.001)
            now_held = sched.statistics().in_system
            freed += [trio.current_time() - t0] * (held - now_held)
            held = now_held
        # (t0 is a few virtual ms after the first request began: compare spacings)
        spacing = [f - freed[0] for f in freed]
        assert spacing == pytest.approx([0.0, 0.20, 0.20, 0.60], abs=0.0015)
        # Each is told its place's estimate plus the promise's margin; the estimate is
        # within one engine step (it cannot know how far into a step it is made).
        estimate = [(t - sched.margin) / (1 + sched.margin_fraction) for t in told]
        assert estimate[:3] == pytest.approx(freed[:3], abs=engine.step_s + 0.001)
        assert all(e >= freed[2] - engine.step_s for e in estimate[3:])
        assert told == sorted(told)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
async def test_a_failed_request_log_is_shown_on_ready_and_metrics(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FakeEngine(step_s=0.01)
    async with running(tmp_path, engine, request_log_jsonl="/dev/full") as app:
        r = await request(app, "POST", GEN, {"prompt": "hi", "max_new_tokens": 2})
        assert r.status == 200  # serving goes on
        # The writer thread finds the failure; on the autojump clock this loop costs
        # little real time, and the guard trips (in virtual time) if it never does.
        with trio.fail_after(10_000):
            while app.lifespan.log.failure is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
        ready = await request(app, "GET", "/ready")
        assert ready.status == 200
        log = ready.json()["request_log"]
        assert log["ok"] is False
        assert log["dropped"] >= 1
        assert "No space left" in log["error"]
        metrics = (await request(app, "GET", "/metrics")).body.decode()
        assert "ninfer_request_log_failed 1.0" in metrics
