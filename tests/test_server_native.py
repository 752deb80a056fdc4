"""/health, /ready, /v1/generate with the tiny model: in-process over its real engine, and
over a real socket for what needs one (framing, uploads, streams read as they come)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from conftest import counting_tokenizer
from server import SERVER_HANG_GUARD_S, serve, serve_app, serve_model

GEN = "/v1/generate"


def _sse_events(text: str) -> list[tuple[str, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event", "message"), orjson.loads(lines["data"])))
    return out


async def test_generate_contract_field_by_field(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        r = await c.post(
            GEN,
            json={"prompt": "the cat", "max_new_tokens": 7, "temperature": 0, "top_k": 3},
            headers={"x-request-id": "client-id.42"},
        )
        assert r.status_code == 200
        body = r.json()
        assert body["id"] == r.headers["x-request-id"] == "client-id.42"
        assert set(body) == {
            "id", "model", "text", "token_ids", "finish_reason", "stop_sequence", "seed",
            "usage", "warnings", "timing",
        }  # fmt: skip
        assert body["model"] == {
            "id": "tiny-test-llama",
            "architecture": "llama",
            "sha256": srv.app.lifespan.model.identity.sha256,  # type: ignore[union-attr]
        }
        assert len(body["token_ids"]) == body["usage"]["completion_tokens"] <= 7
        assert body["finish_reason"] in ("length", "eos")
        prompt_ids = srv.app.lifespan.model.tokenizer.encode("the cat")  # type: ignore[union-attr]
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        assert body["usage"]["total_tokens"] == len(prompt_ids) + len(body["token_ids"])
        assert body["warnings"] == ["top_k has no effect with greedy decoding (temperature 0)"]
        assert set(body["timing"]) == {"prepare", "queue", "ttft", "prefill", "decode", "total"}
        assert all(v >= 0 for v in body["timing"].values())
        assert r.headers["server-timing"].startswith("total;dur=")
        # An insane client id is replaced, not echoed.
        r2 = await c.post(GEN, json={"prompt": "x"}, headers={"x-request-id": "bad id with spaces"})
        assert r2.headers["x-request-id"].startswith("req-")


async def test_stream_matches_the_whole_response(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        req = {"prompt": "in the", "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        whole = (await c.post(GEN, json=req)).json()
        r = await c.post(GEN, json={**req, "stream": True})
        assert r.headers["content-type"] == "text/event-stream"
        events = _sse_events(r.text)
        kinds = [k for k, _ in events]
        assert kinds[-1] == "done"
        assert set(kinds[:-1]) == {"token"}
        ids = [i for k, d in events if k == "token" for i in d["token_ids"]]
        text = "".join(d["text"] for k, d in events if k == "token")
        assert ids == whole["token_ids"]
        assert text == whole["text"]
        done = events[-1][1]
        assert done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 12


async def test_stop_string_ends_the_text(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        req = {"prompt": "and", "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
        full = (await c.post(GEN, json=req)).json()["text"]
        stop = full[5:8]
        r = (await c.post(GEN, json={**req, "stop": [stop]})).json()
        assert r["finish_reason"] == "stop"
        assert r["stop_sequence"] == stop
        assert r["text"] == full[: full.index(stop)]


async def test_seeded_sampling_repeats(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        req = {"prompt": "the", "max_new_tokens": 10, "temperature": 1.0, "seed": 5}
        a, b = (await c.post(GEN, json=req)).json(), (await c.post(GEN, json=req)).json()
        assert a["token_ids"] == b["token_ids"]
        assert a["seed"] == 5


@pytest.mark.parametrize(
    ("body", "status", "kind", "param"),
    [
        (b"{not json", 400, "malformed_json", None),
        (b"", 400, "malformed_json", None),
        (b'{"prompt": NaN}', 400, "malformed_json", None),
        (b'{"prompt": "\\ud800"}', 400, "malformed_json", None),
        (b"[" * 20000 + b"]" * 20000, 400, "malformed_json", None),
        (b"[1]", 422, "invalid_request", None),
        (b'"text"', 422, "invalid_request", None),
        (b'{"prompt": "x", "max_new_tokens": "5"}', 422, "invalid_request", "max_new_tokens"),
        (b'{"prompt": "x", "max_new_tokens": 5.0}', 422, "invalid_request", "max_new_tokens"),
        (b'{"prompt": "x", "max_new_tokens": true}', 422, "invalid_request", "max_new_tokens"),
        (b'{"prompt": "x", "max_new_tokens": null}', 422, "invalid_request", "max_new_tokens"),
        (b'{"prompt": "x", "max_new_tokens": 0}', 422, "invalid_request", "max_new_tokens"),
        (b'{"prompt": "x", "temperature": 2.5}', 422, "invalid_request", "temperature"),
        (b'{"prompt": "x", "top_p": 0}', 422, "invalid_request", "top_p"),
        (b'{"prompt": "x", "seed": -1}', 422, "invalid_request", "seed"),
        (b'{"prompt": "x", "stop": ["a","b","c","d","e"]}', 422, "invalid_request", "stop"),
        (b'{"prompt": "x", "stop": [""]}', 422, "invalid_request", "stop[0]"),
        (b'{"prompt": "x", "stop": "a"}', 422, "invalid_request", "stop"),
        (b'{"prompt": "x", "stream": "yes"}', 422, "invalid_request", "stream"),
        (b'{"prompt": "x", "max_tokens": 5}', 422, "invalid_request", "max_tokens"),
        (b'{"prompt": ""}', 422, "invalid_request", "prompt"),
        (b'{"max_new_tokens": 5}', 422, "invalid_request", "prompt"),
        (
            b'{"prompt": "x", "max_new_tokens": 600}',
            422,
            "context_length_exceeded",
            "max_new_tokens",
        ),
    ],
)
async def test_errors_have_one_shape(
    tmp_path: Path, body: bytes, status: int, kind: str, param: str | None
) -> None:
    """The native envelope of every refusal of a body (the app over a fake engine with a
    512-token context: the shape of the answer is the protocol's, whatever the model)."""
    async with serve_app(tmp_path) as srv, srv.client() as c:
        r = await c.post(GEN, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"type", "message", "param", "request_id"}
        assert (err["type"], err["param"]) == (kind, param)
        assert err["request_id"] == r.headers["x-request-id"]
        assert b"ud800" not in r.content
        assert len(r.content) < 1024


async def test_budget_over_the_context_names_the_numbers(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, max_context=64) as srv, srv.client() as c:
        long_prompt = "x " * 200
        r = await c.post(GEN, json={"prompt": long_prompt})
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["type"] == "context_length_exceeded"
        assert err["param"] == "prompt"
        assert "64" in err["message"]
        r = await c.post(GEN, json={"prompt": "the cat", "max_new_tokens": 63})
        err = r.json()["error"]
        assert (r.status_code, err["type"], err["param"]) == (
            422,
            "context_length_exceeded",
            "max_new_tokens",
        )


async def test_routing_errors(tmp_path: Path) -> None:
    async with serve_app(tmp_path) as srv, srv.client() as c:
        r = await c.get("/nope")
        assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found")
        r = await c.get(GEN)
        assert (r.status_code, r.headers["allow"]) == (405, "POST")
        r = await c.post(GEN, content=b'{"prompt":"x"}', headers={"content-type": "text/plain"})
        assert (r.status_code, r.json()["error"]["type"]) == (415, "unsupported_media_type")


SHIPPED_CONTRACT = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"


async def test_version(tiny_gguf: Path, tmp_path: Path) -> None:
    """GET /version: ninfer's, torch's and the request log schema's versions; not a
    request the log records. GET /openapi.json: the shipped contract, whole. GET
    /props: the model, its context, slots, template and defaults."""
    import torch

    from ninfer import __version__
    from ninfer._requestlog import SCHEMA_VERSION

    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        r = await c.get("/version")
        contract = await c.get("/openapi.json")
        props = (await c.get("/props")).json()
    assert props["model"] == srv.app.lifespan.public_id
    assert props["served_names"] == [srv.app.lifespan.public_id]
    assert props["n_ctx"] == props["default_generation_settings"]["n_ctx"] > 0
    assert props["total_slots"] == srv.app.config.max_concurrency
    assert "{%" in props["chat_template"]  # the tiny model's ChatML template
    assert props["capabilities"]["chat"] is props["capabilities"]["structured_outputs"] is True
    # llama-server's default chain, where nothing names another
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (
        0.8,
        40,
        0.95,
        0.05,
    )
    # llama-server's fields (its web UI reads them)
    assert props["model_path"] == str(tiny_gguf)
    assert props["model_alias"] == srv.app.lifespan.public_id
    assert (props["bos_token"], props["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    # what a chat request naming no budget gets: up to the room left, as the web UI reads
    # it; the native route's own default beside it
    assert (params["max_tokens"], params["n_predict"], params["max_new_tokens"]) == (-1, -1, 512)
    assert props["chat_template_caps"]["supports_tools"] is True
    assert props["is_sleeping"] is False
    assert contract.json() == json.loads(SHIPPED_CONTRACT.read_bytes())
    assert "/version" in contract.json()["paths"]
    assert r.status_code == 200
    assert r.json() == {"version": __version__, "torch": torch.__version__,
                        "request_log_schema": SCHEMA_VERSION}  # fmt: skip
    assert not [rec for rec in srv.log_records() if rec.get("endpoint") == "/version"]


async def test_head_is_get_without_the_body(tiny_gguf: Path, tmp_path: Path) -> None:
    """HEAD on a GET route (a balancer's or uptime checker's probe) answers the GET's
    status and headers with no body, over a real socket; a route without GET still
    says which methods it has."""
    async with serve(tiny_gguf, tmp_path) as srv, srv.client() as c:
        for path in ("/health", "/ready", "/v1/models"):
            got, head = await c.get(path), await c.head(path)
            assert (head.status_code, head.content) == (got.status_code, b""), path
            assert head.headers["content-type"] == got.headers["content-type"]
        r = await c.head(GEN)
        assert (r.status_code, r.headers["allow"]) == (405, "POST")
        assert (await c.get("/health")).status_code == 200  # the connection goes on


async def test_api_key(tmp_path: Path) -> None:
    """Who may ask what (the app over a fake engine: the key is checked before any
    route's work)."""
    async with serve_app(tmp_path, api_key="s3cret") as srv, srv.client() as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).status_code == 200
        assert (await c.get("/version")).status_code == 401
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1})
        assert (r.status_code, r.json()["error"]["type"]) == (401, "unauthorized")
        r = await c.post(
            GEN, json={"prompt": "x", "max_new_tokens": 1}, headers={"authorization": "Bearer nope"}
        )
        assert r.status_code == 401
        for h in ({"authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1}, headers=h)
            assert r.status_code == 200
        # A wrong key does not ride on a right one: every key presented must be the key.
        for pairs in (
            [("x-api-key", "s3cret"), ("x-api-key", "nope")],
            [("x-api-key", "nope"), ("x-api-key", "s3cret")],
            [("authorization", "Bearer s3cret"), ("x-api-key", "nope")],
            [("x-api-key", "s3cret"), ("authorization", "Bearer nope")],
        ):
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1}, headers=pairs)
            assert r.status_code == 401, pairs
        both = [("authorization", "Bearer s3cret"), ("x-api-key", "s3cret")]
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1}, headers=both)
        assert r.status_code == 200
    assert b"s3cret" not in srv.log_path.read_bytes()
    public = {"api_key": "s3cret", "metrics_public": True}
    async with serve_app(tmp_path, **public) as srv, srv.client() as c:
        assert (await c.get("/metrics")).status_code == 200  # scraped without the key
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1})
        assert r.status_code == 401  # the rest still needs it


async def test_body_limits_declared_and_chunked(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, max_request_mib=0.01) as srv, srv.client() as c:
        big = b'{"prompt": "' + b"a" * 20000 + b'"}'
        r = await c.post(GEN, content=big, headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["type"]) == (413, "payload_too_large")

        async def chunks():  # type: ignore[no-untyped-def]
            yield b'{"prompt": "'
            for _ in range(40):
                yield b"a" * 1000
            yield b'"}'

        r = await c.post(GEN, content=chunks(), headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["type"]) == (413, "payload_too_large")


async def test_stalled_upload_gets_408(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, read_timeout_s=0.5) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"prompt"'
        )
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = await stream.receive_some()
            if not chunk:
                break
            data += chunk
        assert data.startswith(b"HTTP/1.1 408")
        assert b"request_timeout" in data
        await stream.aclose()


async def test_health_answers_while_the_engine_decodes(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path) as srv, srv.client() as c:
        body = {"prompt": "x", "max_new_tokens": 400, "ignore_eos": True, "stream": True}
        async with c.stream("POST", GEN, json=body) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break  # its first token: the request is decoding now
            engine = srv.app.lifespan.service
            h = await c.get("/health")
            assert h.status_code == 200
            assert engine.statistics().decoding == 1, "health answered while decoding"
            rest = [line async for line in lines]
        assert r.status_code == 200
        assert "event: done" in rest


async def test_disconnect_mid_stream_frees_the_slot(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, max_concurrency=1, max_pending_requests=0) as srv:
        async with (
            srv.client() as c1,
            c1.stream(
                "POST",
                GEN,
                json={"prompt": "x", "max_new_tokens": 400, "stream": True, "ignore_eos": True},
            ) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        # The client is gone: the slot and pages come back, and the next request runs at once.
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        while sched.statistics().in_system:
            await trio.lowlevel.checkpoint()
        async with srv.client() as c2:
            r2 = await c2.post(GEN, json={"prompt": "x", "max_new_tokens": 2})
            assert r2.status_code == 200
        engine = srv.app.lifespan.service
        assert engine is not None
        while engine.statistics().pages_used:
            await trio.lowlevel.checkpoint()
    records = srv.log_records()
    cancelled = [r for r in records if r["event"] == "request_cancelled"]
    assert len(cancelled) == 1
    assert cancelled[0]["stage"] in ("decode", "prefill")


async def test_overload_burst_gets_200_429_503_and_the_log_agrees(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    async with (
        serve(
            tiny_gguf, tmp_path, max_concurrency=2, max_pending_requests=3, pending_timeout_ms=300
        ) as srv,
        srv.client(limits=httpx.Limits(max_connections=50)) as c,
    ):
        statuses: dict[str, int] = {}
        retry_after: list[str | None] = []

        async def one(i: int) -> None:
            r = await c.post(
                GEN,
                json={"prompt": "x", "max_new_tokens": 60, "ignore_eos": True},
                headers={"x-request-id": f"burst-{i}"},
            )
            statuses[f"burst-{i}"] = r.status_code
            if r.status_code != 200:
                retry_after.append(r.headers.get("retry-after"))

        async with trio.open_nursery() as n:
            for i in range(30):
                n.start_soon(one, i)
    assert set(statuses.values()) <= {200, 429, 503}
    assert 429 in statuses.values()
    assert all(v is not None and int(v) >= 1 for v in retry_after)
    terminal = {"request_done", "request_rejected", "request_error", "request_cancelled"}
    records = [r for r in srv.log_records() if r["event"] in terminal]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_id.setdefault(rec["request_id"], []).append(rec)
    assert set(by_id) == set(statuses)
    assert all(len(v) == 1 for v in by_id.values()), "exactly one terminal record each"
    for rid, status in statuses.items():
        rec = by_id[rid][0]
        if status == 200:
            assert rec["event"] == "request_done"
        else:
            assert (rec["event"], rec["status"]) == ("request_rejected", status)


async def test_queue_timeout_is_503_with_retry_after(tiny_gguf: Path, tmp_path: Path) -> None:
    """A request waiting behind a running one past --pending-timeout-ms gets 503 with
    Retry-After. The running one is a stream nobody reads: it holds its slot however
    fast the machine decodes."""
    async with (
        serve(
            tiny_gguf, tmp_path, max_concurrency=1, max_pending_requests=4, pending_timeout_ms=200
        ) as srv,
        srv.client() as c,
    ):
        hog = {"prompt": "x", "max_new_tokens": 450, "ignore_eos": True, "stream": True}
        async with c.stream("POST", GEN, json=hog) as stream:
            assert stream.status_code == 200
            sched = srv.app.lifespan.scheduler
            assert sched is not None
            while sched.statistics().running == 0:
                await trio.lowlevel.checkpoint()
            t0 = trio.current_time()
            r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 2})
            waited = trio.current_time() - t0
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "request_queue_timeout"
        assert int(r.headers["retry-after"]) >= 1
        assert waited >= 0.2


async def test_draining_refuses_new_requests(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        srv.app.lifespan.begin_drain()
        r = await c.post(GEN, json={"prompt": "x"})
        assert (r.status_code, r.json()["error"]["type"]) == (503, "shutting_down")
        # what remains of the drain (--graceful-timeout-s, 10 s by default)
        assert 1 <= int(r.headers["retry-after"]) <= 10
        assert 1000 <= int(r.headers["retry-after-ms"]) <= 10_000
        r = await c.get("/ready")
        assert (r.status_code, r.json()["error"]["type"]) == (503, "shutting_down")


async def test_a_small_kv_pool_clamps_the_default_budget(tiny_gguf: Path, tmp_path: Path) -> None:
    """`--kv-capacity 10` (one page of 16 tokens): a request that names no budget is
    served within what the pool holds, as the docs promise; one that names more than
    the pool holds is refused with the numbers."""
    async with serve_model(tiny_gguf, tmp_path, kv_capacity=10) as srv, srv.client() as c:
        r = await c.post(GEN, json={"prompt": "the cat", "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 16
        assert r.json()["finish_reason"] == "length"
        r = await c.post(GEN, json={"prompt": "the cat", "max_new_tokens": 20})
        assert r.status_code == 422
        assert (r.json()["error"]["type"], r.json()["error"]["param"]) == (
            "context_length_exceeded",
            "max_new_tokens",
        )


async def test_a_dead_engine_fails_health_and_says_why(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the engine thread dies, /health fails (a liveness probe restarts the process)
    and /ready, the console and the log give the real cause, not a wrapper's."""
    from ninfer.engine._engine import Engine

    def dies(self: Engine) -> None:
        raise RuntimeError("planted engine death in /opt/models/x.gguf")

    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        assert (await c.get("/health")).status_code == 200
        monkeypatch.setattr(Engine, "_step", dies)
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 2})
        assert r.status_code == 500
        with trio.fail_after(SERVER_HANG_GUARD_S):
            await srv.app.lifespan.service.failed.wait()
        for route in ("/health", "/ready"):
            r = await c.get(route)
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["type"] == "engine_unavailable"
            assert "RuntimeError: planted engine death" in err["message"]
            assert "/opt/models" not in err["message"]
    (died,) = [r for r in srv.log_records() if r.get("message") == "engine_died"]
    assert died["level"] == "error"
    assert died["error"].startswith("RuntimeError: planted engine death")
    assert "ExceptionGroup" not in died["error"]
    assert "RuntimeError: planted engine death" in died["exception"]


async def test_retry_after_stays_in_the_documented_range(tiny_gguf: Path, tmp_path: Path) -> None:
    """A drain longer than a minute is still advised as at most 60 s (docs/errors.md)."""
    async with serve_model(tiny_gguf, tmp_path, graceful_timeout_s=600.0) as srv, srv.client() as c:
        srv.app.lifespan.begin_drain()
        r = await c.post(GEN, json={"prompt": "x"})
        assert r.status_code == 503
        assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("60", "60000")


async def test_tokenize_and_detokenize_in_both_servers_shapes(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """POST /tokenize as llama.cpp's server (content, add_special, with_pieces) and as
    vLLM (prompt, model, add_special_tokens) ask it, one answer for both (tokens,
    count, max_model_len); POST /detokenize gives llama.cpp's content and vLLM's
    prompt; the text round-trips; mistakes are refused by name."""
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        served = srv.app.lifespan.public_id
        model = srv.app.lifespan.serving.model if srv.app.lifespan.serving else None
        assert model is not None
        text = "the quick fox"
        llama = (await c.post("/tokenize", json={"content": text})).json()
        vllm = (await c.post("/tokenize", json={"prompt": text, "model": served})).json()
        ids = llama["tokens"]
        assert ids == model.tokenizer.encode(text)[-len(ids) :]
        assert (llama["count"], llama["max_model_len"]) == (len(ids), model.max_context)
        assert vllm["tokens"] == model.tokenizer.encode(text)  # BOS where the model wants
        plain = await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert plain.json()["tokens"] == ids
        pieces = (await c.post("/tokenize", json={"content": text, "with_pieces": True})).json()
        assert [p["id"] for p in pieces["tokens"]] == ids
        assert "".join(p["piece"] for p in pieces["tokens"]) == text
        back = (await c.post("/detokenize", json={"tokens": ids})).json()
        assert back == {"content": text, "prompt": text}
        for path, body, param in (
            ("/tokenize", {"content": "a", "prompt": "b"}, "content"),
            ("/tokenize", {}, "content"),
            ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}, "messages"),
            ("/tokenize", {"content": "a", "model": "nope"}, "model"),
            ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
        ):
            r = await c.post(path, json=body)
            assert r.status_code in (400, 404, 422), (path, body, r.text)
            assert r.json()["error"]["param"] == param, r.text


async def test_tokenize_pieces_carry_their_bytes_and_special_text_can_be_plain(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """with_pieces as llama.cpp's server answers it: a piece that is not UTF-8 on its own
    (a byte-level token holding part of a character) is its bytes, so the pieces
    round-trip the text's bytes; parse_special false reads a control token's text as
    plain text (true, the default, as that token)."""
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        text = "caf\u00e9 \u65e5\u672c"  # 2- and 3-byte characters, a byte a token here
        pieces = (await c.post("/tokenize", json={"content": text, "with_pieces": True})).json()
        parts = [p["piece"] for p in pieces["tokens"]]
        assert any(isinstance(p, list) for p in parts)  # e.g. [230], [151], [165]
        raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts)
        assert raw == text.encode()
        control = "<|im_end|>"
        special = (await c.post("/tokenize", json={"content": control})).json()["tokens"]
        plain = await c.post("/tokenize", json={"content": control, "parse_special": False})
        assert len(special) == 1
        assert len(plain.json()["tokens"]) > 1
        back = await c.post("/detokenize", json={"tokens": plain.json()["tokens"]})
        assert back.json()["content"] == control


async def test_tokenize_and_detokenize_take_no_more_than_a_context(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """A text of more tokens than the context is refused by /tokenize as a prompt of
    that length is (422 context_length_exceeded naming the field, with the count),
    and /detokenize takes at most a context's worth of ids (422 naming `tokens`);
    a context's worth exactly is answered (docs/api.md)."""
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        assert srv.app.lifespan.serving is not None
        context = srv.app.lifespan.serving.model.max_context
        word = "hello "
        per_word = len((await c.post("/tokenize", json={"content": word * 10})).json()["tokens"])
        fits = word * ((context - 16) * 10 // per_word)
        assert (await c.post("/tokenize", json={"content": fits})).status_code == 200
        for field in ("content", "prompt"):
            r = await c.post("/tokenize", json={field: fits + word * 10})
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("context_length_exceeded", field)
            assert str(context) in error["message"]
        ids = (await c.post("/tokenize", json={"content": "x"})).json()["tokens"][:1]
        whole = await c.post("/detokenize", json={"tokens": ids * context})
        assert whole.status_code == 200
        assert len(whole.json()["content"]) == context
        r = await c.post("/detokenize", json={"tokens": ids * (context + 1)})
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["param"]) == (
            "invalid_request", "tokens")  # fmt: skip


async def test_a_hopeless_text_costs_a_contexts_worth_of_tokenizing(tmp_path: Path) -> None:
    """A 300 KB text to /tokenize and /v1/generate, within the bytes a context could
    cover but ten times its tokens: refused (422 context_length_exceeded, naming the
    field) once the count, taken in pieces, passes the context: the characters
    tokenized are the context's worth and a piece or two more, not the text's (a
    figure of work, not of time: the same on any machine)."""
    from tinymodel import write_tiny_gguf

    from ninfer.engine._tokenizer import PIECE_CHARS

    model = write_tiny_gguf(tmp_path / "long.gguf", context=32768)
    async with serve_model(model, tmp_path) as srv, srv.client() as c:
        assert srv.app.lifespan.serving is not None
        tok = srv.app.lifespan.serving.model.tokenizer
        text = "hello world " * 25_000
        assert len(text) < 32768 * tok.max_token_bytes  # not refused by its bytes alone
        per_token = len(text[:120]) / len(tok.encode_plain(text[:120]))
        with counting_tokenizer(tok) as seen:
            for path, field in (("/tokenize", "content"), ("/v1/generate", "prompt")):
                seen.clear()
                r = await c.post(path, json={field: text})
                assert r.status_code == 422, r.text
                error = r.json()["error"]
                assert (error["type"], error["param"]) == ("context_length_exceeded", field)
                assert sum(seen) <= 32768 * per_token + 2 * PIECE_CHARS, (path, sum(seen))


async def test_each_request_has_an_access_line_unless_turned_off(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One console line per request, in the console's format: method, route (never the
    raw path), status, tokens when it generated, seconds; none for the probes, and
    none at all with --no-access-log."""
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        await c.get("/health")
        r = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200
        await c.get("/no/such/secret-path")
    lines = [line for line in capsys.readouterr().err.splitlines() if " access " in line]
    assert len(lines) == 2, lines
    done, missing = lines
    assert "method=POST route=/v1/generate status=200" in done
    assert "tokens=" in done
    assert "+3" in done
    assert r.headers["x-request-id"] in done
    assert "route=unmatched status=404" in missing
    assert "secret-path" not in missing
    async with serve_model(tiny_gguf, tmp_path, no_access_log=True) as srv, srv.client() as c:
        await c.post(GEN, json={"prompt": "x", "max_new_tokens": 1})
    assert " access " not in capsys.readouterr().err
