"""Resumable streams (llama-server's, which its web UI resumes after a reload): a stream
sent with X-Conversation-Id goes on when its client leaves, GET /v1/stream replays it
from an offset and follows it to its end, POST /v1/streams/lookup finds it, DELETE
/v1/stream stops it, and one that nobody comes back for is cancelled once
--stream-resume-s has passed, to the exact virtual instant (the app over a fake engine
on the autojump clock: one token "a" a step). Every way out is one terminal record
that says which."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio.testing
from fakeengine import AsgiClient, FakeEngine, Response, request
from server import SERVER_HANG_GUARD_S, serve
from server import running_app as running
from server import wait_for as _wait_for

from ninfer._app import App
from ninfer._streams import OffsetLost, StreamSession, StreamSessions, conversation_id

CHAT = "/v1/chat/completions"
STEP_S = 0.01


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "requests.jsonl").read_bytes().splitlines()
    return [orjson.loads(line) for line in lines]


def _terminal(tmp_path: Path, rid: str) -> dict[str, Any]:
    ends = ("request_done", "request_cancelled", "request_error", "request_rejected")
    (rec,) = [r for r in _records(tmp_path) if r["request_id"] == rid and r["event"] in ends]
    return rec


def _chat(app: App, rid: str, conv: str | None, tokens: int) -> AsgiClient:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]
    if conv is not None:
        headers.append((b"x-conversation-id", conv.encode()))
    c = AsgiClient(app, "POST", CHAT, headers=headers)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    c.send_body(orjson.dumps(body))
    return c


def _reader(app: App, method: str, path: str, query: str) -> AsgiClient:
    c = AsgiClient(app, method, path, headers=[])
    c.scope["query_string"] = query.encode()
    c.send_body(b"")
    return c


def _content(body: bytes) -> tuple[str, bool]:
    """A chat stream's text, and whether it ended with [DONE]."""
    text = ""
    for line in body.decode().split("\n"):
        if line.startswith("data: {"):
            for choice in orjson.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text, body.endswith(b"data: [DONE]\n\n")


async def _lookup(app: App, ids: list[str]) -> Response:
    return await request(app, "POST", "/v1/streams/lookup", {"conversation_ids": ids})


def _quiet(app: App, engine: FakeEngine) -> None:
    assert app.lifespan.scheduler is not None
    s = app.lifespan.scheduler.statistics()
    assert (s.in_system, s.running, s.units_used) == (0, 0, 0)
    assert engine.active == 0


async def test_a_stream_whose_client_left_is_resumed_from_its_offset(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The client leaves mid-answer (a reload); the generation goes on; the page comes
    back, finds the stream and reads it on from the byte it had: the two parts are the
    whole answer, nothing twice, and the log says the client left and one reader came."""
    engine = FakeEngine(step_s=STEP_S)
    async with running(tmp_path, engine) as app, trio.open_nursery() as n:
        first = _chat(app, "r1", "conv-1", 300)
        n.start_soon(first.run)
        await _wait_for(lambda: first.response.body.count(b"data: {") >= 20)
        first.disconnect()
        await trio.sleep(50 * STEP_S)  # a reload's time: tokens go on into the session
        assert engine.active == 1
        had = len(first.response.body)  # what reached the client before it left
        found = await _lookup(app, ["conv-1", "other"])
        assert found.status == 200
        (entry,) = found.json()
        assert entry["conversation_id"] == "conv-1"
        assert entry["is_done"] is False
        assert entry["total_bytes"] > had
        assert entry["completed_at"] == 0
        rest = _reader(app, "GET", "/v1/stream", f"conv_id=conv-1&from={had}")
        await rest.run()  # follows the live stream to its end
        assert rest.response.status == 200
        assert rest.response.headers[b"content-type"] == b"text/event-stream"
        text, ended = _content(first.response.body + rest.response.body)
        assert (text, ended) == ("a" * 300, True)
        # From the start, the whole stream again (a page that lost everything).
        again = _reader(app, "GET", "/v1/stream", "conv_id=conv-1")
        await again.run()
        assert again.response.body == first.response.body + rest.response.body
        (entry,) = (await _lookup(app, ["conv-1"])).json()
        assert entry["is_done"] is True
        assert entry["completed_at"] > 0
        _quiet(app, engine)
    done = _terminal(tmp_path, "r1")
    assert done["event"] == "request_done"
    assert done["stream_session"] == {"client_left": True, "resumes": 1}
    assert engine.cancelled == []
    (start,) = [r for r in _records(tmp_path) if r["event"] == "request_start"]
    assert start["resumable"] is True


async def test_a_stream_nobody_comes_back_for_is_cancelled_after_the_bound(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """--stream-resume-s of no reader, counted from the client's leaving and again from
    a reader's: then the generation is cancelled as a disconnect always was."""
    engine = FakeEngine(step_s=STEP_S)
    async with running(tmp_path, engine, stream_resume_s=2.0) as app, trio.open_nursery() as n:
        c = _chat(app, "r2", "conv-2", 5000)
        n.start_soon(c.run)
        await _wait_for(lambda: b"data: {" in c.response.body)
        c.disconnect()
        left = trio.current_time()
        await trio.sleep(1.5)
        # A reader comes and goes before the bound: the wait starts again when it leaves.
        peek = _reader(app, "GET", "/v1/stream", "conv_id=conv-2")
        async with trio.open_nursery() as inner:
            inner.start_soon(peek.run)
            await _wait_for(lambda: len(peek.response.body) > 0)
            await trio.sleep(1.0)
            peek.disconnect()
            reader_left = trio.current_time()
        await _wait_for(lambda: engine.active == 0)
        assert trio.current_time() - reader_left == pytest.approx(2.0, abs=2 * STEP_S)
        assert trio.current_time() - left > 4.0
        _quiet(app, engine)
        (entry,) = (await _lookup(app, ["conv-2"])).json()
        assert entry["is_done"] is True  # what it said stays readable for a while
    rec = _terminal(tmp_path, "r2")
    assert (rec["event"], rec["stage"], rec["cause"]) == (
        "request_cancelled",
        "decode",
        "abandoned",
    )
    assert engine.cancelled == ["r2"]


async def test_delete_stops_the_generation_and_a_new_one_replaces_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The web UI's Stop (DELETE /v1/stream) ends the generation at once; a second
    generation of one conversation (regenerate) stops the first. Each says why."""
    engine = FakeEngine(step_s=STEP_S)
    async with running(tmp_path, engine) as app, trio.open_nursery() as n:
        old = _chat(app, "old", "conv-3", 5000)
        n.start_soon(old.run)
        await _wait_for(lambda: b"data: {" in old.response.body)
        new = _chat(app, "new", "conv-3", 5000)
        n.start_soon(new.run)
        await old.finished.wait()
        await _wait_for(lambda: b"data: {" in new.response.body)
        new.disconnect()  # a reload, then Stop
        stop = _reader(app, "DELETE", "/v1/stream", "conv_id=conv-3")
        await stop.run()
        assert (stop.response.status, stop.response.body) == (204, b"")
        await _wait_for(lambda: engine.active == 0)
        gone = _reader(app, "GET", "/v1/stream", "conv_id=conv-3")
        await gone.run()
        assert gone.response.status == 404
        assert (await _lookup(app, ["conv-3"])).json() == []
        again = _reader(app, "DELETE", "/v1/stream", "conv_id=conv-3")
        await again.run()
        assert again.response.status == 204  # as llama-server: nothing to stop is fine
        _quiet(app, engine)
    assert _terminal(tmp_path, "old")["cause"] == "replaced"
    assert _terminal(tmp_path, "new")["cause"] == "stopped"
    assert sorted(engine.cancelled) == ["new", "old"]


async def test_without_the_header_or_with_resumes_off_a_leaving_client_cancels(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Only a stream that names its conversation outlives its client, and only while
    resumes are on: otherwise a disconnect cancels it at once, as always."""
    for rid, conv, settings in [("plain", None, {}), ("off", "conv-4", {"stream_resume_s": 0})]:
        engine = FakeEngine(step_s=STEP_S)
        async with running(tmp_path, engine, **settings) as app, trio.open_nursery() as n:
            c = _chat(app, rid, conv, 5000)
            n.start_soon(c.run)
            await _wait_for(lambda c=c: b"data: {" in c.response.body)
            c.disconnect()
            await c.finished.wait()
            _quiet(app, engine)
            missing = await _lookup(app, ["conv-4"])
            assert missing.status == (404 if settings else 200)
        rec = _terminal(tmp_path, rid)
        assert (rec["event"], "cause" in rec) == ("request_cancelled", False)


async def test_what_the_stream_routes_refuse(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FakeEngine(step_s=STEP_S)
    async with running(tmp_path, engine) as app:
        c = _chat(app, "r5", "conv-5", 3)
        await c.run()
        size = len(c.response.body)
        cases: list[tuple[str, str, str, int, str | None]] = [
            ("GET", "/v1/stream", "", 400, "conv_id"),
            ("GET", "/v1/stream", "conv_id=nobody", 404, None),
            ("GET", "/v1/stream", f"conv_id=conv-5&from={size + 1}", 400, "from"),
            ("GET", "/v1/stream", "conv_id=conv-5&from=-1", 400, "from"),
            ("GET", "/v1/stream", "conv_id=conv-5&from=x", 400, "from"),
            ("DELETE", "/v1/stream", "", 400, "conv_id"),
            ("GET", "/tools", "", 403, None),
            ("POST", "/tools", "", 403, None),
        ]
        for method, path, query, status, param in cases:
            r = _reader(app, method, path, query)
            await r.run()
            assert r.response.status == status, (method, path, query)
            error = r.response.json()["error"]
            assert error["param"] == param
        whole = _reader(app, "GET", "/v1/stream", f"conv_id=conv-5&from={size}")
        await whole.run()  # from the very end: nothing more, and the end
        assert (whole.response.status, whole.response.body) == (200, b"")
        for body in ({"conversation_ids": "conv-5"}, {"conversation_ids": [1]}, []):
            r = await request(app, "POST", "/v1/streams/lookup", body)
            assert r.status == 400
            assert r.json()["error"]["param"] == "conversation_ids"
        assert (await _lookup(app, [])).json() == []
        # A prefix of an id is not the id: only `id` and `id::model` are found.
        assert (await _lookup(app, ["conv"])).json() == []
        assert len((await _lookup(app, ["conv-5"])).json()) == 1


def test_a_session_keeps_its_newest_bytes_and_refuses_what_it_dropped() -> None:
    async def main() -> None:
        s = StreamSession("c", 0, lambda _cause: None, limit=10)
        s.append(b"0123456789")
        s.append(b"abcd")
        assert (s.total_bytes, s.dropped) == (14, 4)
        with pytest.raises(OffsetLost):
            async for _ in s.read_from(3):
                pass
        s.finish()
        assert [c async for c in s.read_from(4)] == [b"456789abcd"]
        assert [c async for c in s.read_from(14)] == []
        s.append(b"late")  # nothing enters a finished session
        assert s.total_bytes == 14

    trio.run(main)


def test_finished_sessions_are_kept_for_a_while_within_a_byte_bound() -> None:
    async def main() -> None:
        stops: list[str] = []
        sessions = StreamSessions(60.0, keep_s=10.0, done_bytes=25)
        a = sessions.open("a", stops.append)
        a.append(b"x" * 10)
        sessions.close(a)
        b = sessions.open("b", stops.append)
        b.append(b"y" * 10)
        sessions.close(b)
        c = sessions.open("c", stops.append)  # live: never dropped
        c.append(b"z" * 10)
        assert [e["conversation_id"] for e in sessions.lookup(["a", "b", "c"])] == ["a", "b", "c"]
        d = sessions.open("d", stops.append)
        sessions.close(d)  # never wrote a byte (refused before its stream): dropped
        assert sessions.get("d") is None
        e = sessions.open("e", stops.append)
        e.append(b"w" * 10)
        sessions.close(e)  # 30 finished bytes: the oldest finished goes
        assert sessions.get("a") is None
        assert sessions.get("b") is not None
        await trio.sleep(10.0)
        assert sessions.get("b") is None  # past the keep
        assert sessions.get("c") is c
        sessions.open("c", stops.append)
        assert stops == ["replaced"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_conversation_header_is_taken_only_when_sane() -> None:
    assert conversation_id(b" 4f1c-9::org/model ") == "4f1c-9::org/model"
    for raw in (None, b"", b"a b", b"\xff", b"x" * 513):
        assert conversation_id(raw) is None


async def test_over_a_real_connection_a_reload_resumes_the_answer(tmp_path: Path) -> None:
    """Through Hypercorn: the client closes its connection mid-stream (what a reload
    does), the generation goes on, and GET /v1/stream from the bytes it had gives the
    rest: together the whole answer, ended as a stream ends."""
    engine = FakeEngine(step_s=0.01)
    async with serve(Path("fake"), tmp_path, engine=engine) as srv, srv.client() as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
        headers = {"x-conversation-id": "conv-real", "x-request-id": "real"}
        got = b""
        with trio.fail_after(SERVER_HANG_GUARD_S):
            async with c.stream("POST", CHAT, json=body, headers=headers) as r:
                async for raw in r.aiter_raw():
                    got += raw
                    if got.count(b"data: {") >= 10:
                        break  # leaving the block closes the connection
            rest = await c.get("/v1/stream", params={"conv_id": "conv-real", "from": len(got)})
        assert rest.status_code == 200
        assert _content(got + rest.content) == ("a" * 400, True)
    (done,) = [r for r in srv.log_records() if r["event"] == "request_done"]
    assert done["stream_session"] == {"client_left": True, "resumes": 1}
