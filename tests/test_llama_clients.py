"""What llama-server's own clients send, answered: the requests of llama.cpp's web UI
(tools/ui's chat.service.ts, build 11434: no `model`, `reasoning_format`,
`reasoning_control`, `return_progress`, `timings_per_token`, `sse_ping_interval`,
`backend_sampling`) and of the scripts its README shows (`n_predict`, `max_tokens: -1`,
`repeat_penalty`, `samplers`), over the app in process (a fake engine: one token "a"
a step); llama-server's fields are honoured or refused by name (docs/api.md, "From
llama-server")."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import torch
import trio
from contract import check_answer
from fakeengine import FakeEngine
from server import serve_app, serve_model

from ninfer.engine import SamplingParams
from ninfer.engine._contract import DEFAULT_ORDER
from ninfer.engine._sampling import RowSampler
from ninfer.frontends._sampling import follow_samplers
from protocols import ApiError

CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "hi"}]
# The web UI's body with its settings untouched (chat.service.ts: its model only in
# router mode; `backend_sampling: false` is a setting whose default is sent).
WEB_UI: dict[str, Any] = {
    "messages": QUESTION, "return_progress": True, "sse_ping_interval": 1, "stream": True,
    "reasoning_format": "auto", "reasoning_control": True, "timings_per_token": True,
    "backend_sampling": False,
}  # fmt: skip


def _stream_text(body: bytes) -> tuple[str, str]:
    """The streamed content and the chunks' model."""
    text, model = "", ""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            chunk = orjson.loads(line[6:])
            model = chunk["model"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    return text, model


async def test_the_web_uis_request_is_answered(tmp_path: Path) -> None:
    async with serve_app(tmp_path, served_model_name=["local"]) as srv, srv.client() as c:
        r = await c.post(CHAT, json={**WEB_UI, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert _stream_text(r.content) == ("aaa", "local")  # the served model answers
        # A history with the reasoning the UI keeps, and its thinking budget.
        history = [*QUESTION, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                   {"role": "user", "content": "more"}]  # fmt: skip
        body = {**WEB_UI, "messages": history, "thinking_budget_tokens": 1024, "max_tokens": 2}
        assert (await c.post(CHAT, json=body)).status_code == 200
        # Raw output (the UI's "disable reasoning parsing") cannot be given here.
        raw = await c.post(CHAT, json={**WEB_UI, "reasoning_format": "none"})
        assert raw.status_code == 400
        assert raw.json()["error"]["param"] == "reasoning_format"
        # null is the served model as well; a wrong name is still refused.
        null = await c.post(CHAT, json={"model": None, "messages": QUESTION, "max_tokens": 1})
        assert null.json()["model"] == "local"
        wrong = await c.post(CHAT, json={"model": "other", "messages": QUESTION})
        assert wrong.status_code == 404


BUDGETS: list[tuple[str, dict[str, Any], int]] = [
    (CHAT, {"messages": QUESTION, "n_predict": 5}, 5),
    ("/v1/completions", {"prompt": "hi", "n_predict": 5}, 5),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n_predict": 4}, 4),
    ("/v1/completions", {"prompt": "hi"}, 16),  # OpenAI's legacy default
]


async def test_n_predict_is_the_output_budget(tmp_path: Path) -> None:
    async with serve_app(tmp_path) as srv, srv.client() as c:
        for path, body, tokens in BUDGETS:
            r = await c.post(path, json=body)
            assert r.status_code == 200, (body, r.text)
            assert r.json()["usage"]["completion_tokens"] == tokens


async def test_minus_one_is_as_many_as_there_is_room_for(tmp_path: Path) -> None:
    """max_tokens (or n_predict) -1: up to what the context and the KV pool leave, as a
    request that names no budget on the chat route gets; not clamped (no header)."""
    engine = FakeEngine(step_s=0.0, max_context=64)  # a step a token, without waiting
    async with serve_app(tmp_path, engine=engine) as srv, srv.client() as c:
        context = 64
        for path, field in [(p, f) for p in (CHAT, "/v1/completions")
                            for f in ("max_tokens", "n_predict")]:  # fmt: skip
            base = {"messages": QUESTION} if path == CHAT else {"prompt": "hi"}
            r = await c.post(path, json={**base, field: -1})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == context
            assert "ninfer-max-tokens-clamped" not in r.headers


REFUSED: list[tuple[dict[str, Any], str]] = [
        ({"n_predict": 0}, "n_predict"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -2}, "max_tokens"),
        ({"max_tokens": 5, "n_predict": 6}, "n_predict"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"samplers": ["top_k", "mirostat"]}, "samplers[1]"),
        # the penalties after a stage they change: ninfer runs them first
        ({"samplers": ["temperature", "penalties"], "temperature": 0.7,
          "presence_penalty": 0.5}, "samplers"),
]  # fmt: skip
HONOURED: list[dict[str, Any]] = [
    {"repeat_penalty": 1.1, "repeat_last_n": 64},
    {"repeat_penalty": 1.0, "repeat_last_n": -1},
    {"samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
                  "temperature"], "temperature": 1.0, "top_p": 0.9},
    {"samplers": ["top_k", "temperature"], "top_k": 40, "temperature": 0.5},
    {"samplers": ["temperature", "min_p", "top_p"], "min_p": 0.1, "top_p": 0.9,
     "temperature": 0.7},
    # llama-server's default order at the default chain: temperature last, top-p before
    # min-p, followed as given
    {"samplers": ["top_k", "top_p", "min_p", "temperature"]},
    {"samplers": ["min_p", "temperature"], "min_p": 0.05, "temperature": 0.7},
    {"cache_prompt": True, "return_progress": False},
]  # fmt: skip


async def test_llama_fields_are_honoured_or_refused_by_name(tmp_path: Path) -> None:
    async with serve_app(tmp_path) as srv, srv.client() as c:
        for body, param in REFUSED:
            r = await c.post(CHAT, json={"messages": QUESTION, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, body
        for body in HONOURED:
            r = await c.post(CHAT, json={"messages": QUESTION, "max_tokens": 2, **body})
            assert r.status_code == 200, (body, r.text)


def test_a_stage_left_out_of_the_order_is_off() -> None:
    """llama-server runs only the stages its `samplers` names: the others' values are
    set to off; the penalties too."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                            presence_penalty=0.5, repeat_penalty=1.2)  # fmt: skip
    kept = follow_samplers(("top_k", "temperature"), params)
    assert (kept.temperature, kept.top_k, kept.top_p, kept.min_p) == (0.7, 40, 1.0, 0.0)
    assert (kept.presence_penalty, kept.repeat_penalty) == (0.0, 1.0)
    assert follow_samplers(("top_k",), params).temperature == 1.0
    greedy = SamplingParams(temperature=0.0, top_p=0.5, min_p=0.5)
    assert follow_samplers(("top_p", "min_p", "temperature"), greedy) == greedy  # argmax
    with pytest.raises(ApiError) as refused:
        follow_samplers(("temperature", "penalties"), params)
    assert refused.value.param == "samplers"
    # an order ninfer's computes the same keeps ninfer's; another is followed as given
    same = ("penalties", "top_k", "temperature", "min_p", "top_p")
    assert follow_samplers(same, params).order == DEFAULT_ORDER
    llama = ("penalties", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    assert follow_samplers(llama, params).order == ("top_k", "top_p", "min_p", "temperature")


def _row(params: SamplingParams, seed: int) -> RowSampler:
    return RowSampler.create(attrs.evolve(params, seed=seed), 6)


def test_an_order_of_stages_is_followed() -> None:
    """A filter before the temperature sees the untempered distribution: llama-server's
    order (top-p, then min-p, then temperature) keeps what those filters keep at
    temperature 1 and draws from it tempered; ninfer's own order keeps fewer here. The
    draws land only on the kept tokens, in the tempered proportions."""
    logits = torch.tensor([2.0, 1.6, 1.2, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits.double(), 0)
    # at temperature 1, top-p 0.95 keeps 4 (the mass before the 4th is under 0.95, before
    # the 5th over it) and min-p 0.05 keeps them all (the 4th is over 0.05 x the best)
    assert float(probs[:3].sum()) < 0.95 < float(probs[:4].sum())
    assert float(probs[3]) > 0.05 * float(probs[0])
    llama = SamplingParams(temperature=0.5, top_p=0.95, min_p=0.05,
                           order=("top_k", "top_p", "min_p", "temperature"))  # fmt: skip
    drawn = Counter(_row(llama, seed).pick(logits) for seed in range(4000))
    assert set(drawn) == {0, 1, 2, 3}
    tempered = torch.softmax(logits[:4].double() / 0.5, 0)
    for token, share in enumerate(tempered.tolist()):
        assert abs(drawn[token] / 4000 - share) < 0.03, (token, drawn)
    # temperature first (ninfer's order): at temperature 0.5 the 4th token falls under
    # min-p, and is never drawn
    cooler = torch.softmax(logits.double() / 0.5, 0)
    assert float(cooler[3]) < 0.05 * float(cooler[0])
    ours = attrs.evolve(llama, order=DEFAULT_ORDER)
    assert set(_row(ours, seed).pick(logits) for seed in range(4000)) <= {0, 1, 2}


async def test_llama_servers_completion_route(tmp_path: Path) -> None:
    """POST /completion in llama-server's shapes: a text or token-id prompt, n_predict
    (-1 or none, as llama-server's default: up to the room left), its answer's fields and
    timings, a stream of `data:` events without [DONE] whose last carries `stop: true`
    and the totals."""
    engine = FakeEngine(step_s=0.0)  # a step a token, without waiting
    async with serve_app(tmp_path, engine=engine, default_max_tokens=7) as srv, srv.client() as c:
        unnamed = (await c.post("/completion", json={"prompt": "hello"})).json()
        assert unnamed["tokens_evaluated"] + unnamed["tokens_predicted"] == 512  # the context
        whole = await c.post("/completion", json={"prompt": "hello", "n_predict": 4})
        assert whole.status_code == 200, whole.text
        body = whole.json()
        assert (body["content"], body["stop"], body["stop_type"]) == ("aaaa", True, "limit")
        assert (body["tokens_predicted"], body["tokens_evaluated"]) == (4, 5)
        assert (body["model"], body["prompt"], body["tokens"]) == ("fake", "hello", [])
        assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                        "predicted_per_second"}  # fmt: skip
        ids = await c.post("/completion", json={"prompt": [104, 105], "n_predict": 2,
                                                "return_tokens": True, "stream": True})  # fmt: skip
        events = [
            orjson.loads(line[6:]) for line in ids.text.splitlines() if line.startswith("data: ")
        ]
        assert "[DONE]" not in ids.text
        assert [e["stop"] for e in events] == [False, False, True]
        assert "".join(e["content"] for e in events) == "aa"
        assert all(e["tokens"] for e in events[:2])
        assert events[-1]["tokens_evaluated"] == 2
        rest = await c.post("/completion", json={"prompt": "x", "n_predict": -1, "seed": -1})
        assert rest.json()["tokens_evaluated"] + rest.json()["tokens_predicted"] == 512
        for extra, param in (({"grammar": 'root ::= "a"'}, "grammar"), ({"n_probs": 3}, "n_probs"),
                             ({"n_predict": 0}, "n_predict"), ({"prompt": [10**6]}, "prompt"),
                             ({"model": "other"}, "model")):  # fmt: skip
            r = await c.post("/completion", json={"prompt": "x", **extra})
            assert r.status_code in (404, 422), r.text
            assert r.json()["error"]["param"] == param


async def test_apply_template_health_and_slots(tmp_path: Path) -> None:
    """/apply-template answers the prompt the chat route would tokenize; /v1/health is
    /health; /slots shows --max-concurrency slots, the running request in one."""
    engine = FakeEngine(step_s=0.01)
    async with serve_app(tmp_path, engine=engine, max_concurrency=2) as srv, srv.client() as c:
        applied = await c.post("/apply-template", json={"messages": QUESTION})
        assert applied.json() == {"prompt": "<user>hi<assistant>"}
        assert (await c.get("/v1/health")).json() == {"status": "ok"}
        idle = (await c.get("/slots?fail_on_no_slot=1")).json()
        assert [(s["id"], s["is_processing"]) for s in idle] == [(0, False), (1, False)]
        async with trio.open_nursery() as nursery:
            body = {"prompt": "x", "n_predict": 400}
            nursery.start_soon(partial(c.post, "/completion", json=body,
                                       headers={"x-request-id": "busy"}))  # fmt: skip
            while engine.active == 0:  # noqa: ASYNC110  (the fake engine has no event for it)
                await trio.sleep(0.001)
            slots = (await c.get("/slots")).json()
            nursery.cancel_scope.cancel()
        assert slots[0]["is_processing"] is True
        assert slots[0]["request_id"] == "busy"
        assert slots[1]["is_processing"] is False


async def test_llama_servers_structured_output_shapes(tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-server's structured outputs on the chat route: response_format with the
    schema beside json_object or json_schema, and a top-level json_schema, each enforced
    while decoding; a GBNF grammar refused by name; mistakes refused naming the field."""
    base = {"messages": QUESTION, "max_tokens": 40, "temperature": 0}
    shapes = [
        ({"response_format": {"type": "json_object", "schema": {"const": "42"}}}, '"42"'),
        ({"response_format": {"type": "json_schema", "schema": {"enum": ["foo"]}}}, '"foo"'),
        ({"json_schema": {"const": 7}}, "7"),
    ]
    refused = [
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"response_format": {"type": "text", "schema": {"const": 1}}}, "response_format.schema"),
        ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
        ({"json_schema": {"const": 1}, "response_format": {"type": "json_object"}},
         "json_schema"),
    ]  # fmt: skip
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        for extra, content in shapes:
            r = await c.post(CHAT, json={**base, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["message"]["content"] == content, extra
        for extra, param in refused:
            r = await c.post(CHAT, json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, extra


async def test_llama_servers_logit_bias_forms(tiny_gguf: Path, tmp_path: Path) -> None:
    """/completion's logit_bias in llama-server's forms: [[id, bias]], [[text, bias]] (the
    text's tokens), {"id": bias}, false for a ban; each bans greedy's first token."""
    base = {"prompt": "the capital", "n_predict": 3, "temperature": 0, "return_tokens": True}
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        free = (await c.post("/completion", json=base)).json()
        first = free["tokens"][0]
        text = (await c.post("/detokenize", json={"tokens": [first]})).json()["content"]
        forms: list[Any] = [[[first, False]], [[first, -100]], {str(first): -100}]
        if (await c.post("/tokenize", json={"content": text})).json()["tokens"] == [first]:
            forms.append([[text, False]])  # the text is that one token
        for bias in forms:
            r = await c.post("/completion", json={**base, "logit_bias": bias})
            assert r.status_code == 200, (bias, r.text)
            assert r.json()["tokens"][0] != first, bias
        wrong = [([[first]], "logit_bias[0]"), ([[first, 101]], "logit_bias[0]"),
                 ({"x": "y"}, "logit_bias"), ([[10**6, 1]], "logit_bias[0]")]  # fmt: skip
        for bias, param in wrong:
            r = await c.post("/completion", json={**base, "logit_bias": bias})
            assert r.status_code == 422, (bias, r.text)
            assert r.json()["error"]["param"] == param, bias


def _events(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


async def test_timings_and_prompt_progress(tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-server's statistics, from the engine's own passes: with `return_progress`
    a stream tells the prompt's progress after each prefill pass (0 first, the whole
    prompt last, before the first token); with `timings_per_token` each token's chunk
    carries the timings so far; without either only the last chunk (and a whole
    answer) carries them, as llama-server sends them. All in the documented shapes."""
    words = " ".join(f"w{i}" for i in range(40))
    chat = {"messages": [{"role": "user", "content": words}], "max_tokens": 5,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with serve_model(tiny_gguf, tmp_path, prefill_chunk=16) as srv, srv.client() as c:
        asked = await c.post(CHAT, json={**chat, "return_progress": True,
                                         "timings_per_token": True})  # fmt: skip
        plain = await c.post(CHAT, json={**chat, "messages": [
            {"role": "user", "content": words + " again"}]})  # fmt: skip
        whole = await c.post(CHAT, json={**chat, "stream": False})
        llama = await c.post(
            "/completion",
            json={
                "prompt": words + " more",
                "n_predict": 3,
                "stream": True,
                "return_progress": True,
            },
        )
    for path, r in ((CHAT, asked), (CHAT, plain), (CHAT, whole), ("/completion", llama)):
        assert check_answer(path, r, {}) in ("streamed", "answered")
    events = _events(asked.text)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    first_token = next(i for i, e in enumerate(events) if e["choices"][0]["delta"].get("content"))
    assert all("prompt_progress" not in e for e in events[first_token:])
    total = progress[0]["total"]
    done = [p["processed"] for p in progress]
    assert done[0] == progress[0]["cache"] == 0
    assert done[-1] == total > 16
    assert done == sorted(set(done))
    assert len(done) >= 3  # one a pass of at most 16 tokens
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)
    timed = [e["timings"] for e in events if "timings" in e]
    assert [t["predicted_n"] for t in timed] == [1, 2, 3, 4, 5, 5]  # a token each, the last
    assert {t["prompt_n"] + t["cache_n"] for t in timed} == {total}
    assert all(t["prompt_ms"] > 0 and t["prompt_per_second"] > 0 for t in timed)
    assert [t["predicted_ms"] for t in timed] == sorted(t["predicted_ms"] for t in timed)
    unasked = _events(plain.text)
    assert all("prompt_progress" not in e for e in unasked)
    assert ["timings" in e for e in unasked][-2:] == [False, True]  # the last chunk only
    assert sum("timings" in e for e in unasked) == 1
    body = whole.json()
    assert body["timings"]["predicted_n"] == body["usage"]["completion_tokens"] == 5
    assert body["timings"]["prompt_n"] + body["timings"]["cache_n"] == total
    streamed = _events(llama.text)
    assert streamed[0]["prompt_progress"]["processed"] == 0
    assert [e["stop"] for e in streamed if "prompt_progress" in e] == [False] * sum(
        "prompt_progress" in e for e in streamed
    )
    assert streamed[-1]["stop"]
    assert streamed[-1]["timings"]["predicted_n"] == 3
