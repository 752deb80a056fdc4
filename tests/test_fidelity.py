"""What comes over HTTP is what the engine computes: token for token, greedy and seeded,
against the engine run directly in another process, one request at a time, while the
server batched them; and usage equals an independent count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from server import serve

PREFACE = "A preface shared by two prompts, long enough for several KV pages: " + ", ".join(
    f"item {i} of {i * 3 % 11}" for i in range(14)
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "A list of prime numbers: 2, 3, 5,",
    "Translate to French: good morning",
    "The quick brown fox",
    "In 1969, astronauts",
    "Water boils at",
    "SELECT * FROM users WHERE",
    "Roses are red,",
    "Le chat est",
    "東京は日本の",
    "🙂 emoji and text",
    "1 + 1 =",
    "The mitochondria is",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "Q: What is the tallest mountain?\nA:",
    "x y x y x y",
    "   leading spaces and\ttabs",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "The end.",
    # Two prompts after one long preface: whichever comes second may be served from the
    # prefix cache (whole pages and part of one), and must get the bits computed whole.
    PREFACE + " First, the weather.",
    PREFACE + " Second, the news.",
]


MODEL_NAME = "fidelity"


# A structured output's schema for the constrained cases (bounded: answers can end).
STRUCTURED = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["unit", "days"], "additionalProperties": False,
}  # fmt: skip


def _cases(max_new_tokens: int, seeded: bool, every: int = 1) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for i, prompt in enumerate(PROMPTS):
        if i % every:
            continue
        cases.append({"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0.0})
        if seeded:
            cases.append({"prompt": prompt, "max_new_tokens": max_new_tokens,
                          "temperature": 0.8, "top_p": 0.95, "seed": 1000 + i})  # fmt: skip
        # Log probabilities come from the same float32 logits as the tokens (asked for
        # through /v1/completions).
        cases.append({"prompt": "Scored: " + prompt, "max_new_tokens": max_new_tokens,
                      "temperature": 0.0, "logprobs": 3})  # fmt: skip
        # Constrained rows (structured outputs): the grammar masks the row's own logits,
        # sampled and greedy, batched with the unconstrained ones.
        cases.append({"prompt": "JSON: " + prompt, "max_new_tokens": max_new_tokens,
                      "temperature": 0.9 if i % 2 else 0.0, "seed": 2000 + i,
                      "json_schema": STRUCTURED})  # fmt: skip
    return cases


async def _completion(c: httpx.AsyncClient, case: dict[str, Any]) -> dict[str, Any]:
    """A logprobs case through /v1/completions, in the native answer's terms."""
    body = {"model": MODEL_NAME, "prompt": case["prompt"], "max_tokens": case["max_new_tokens"],
            "temperature": case["temperature"], "logprobs": case["logprobs"],
            "ignore_eos": True}  # fmt: skip
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    lps = answer["choices"][0]["logprobs"]
    return {"usage": answer["usage"], "logprobs": [lps["token_logprobs"], lps["top_logprobs"]],
            "token_ids": None}  # fmt: skip


async def _over_http(srv: Any, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All cases at once (the server batches them); half streamed, half not."""
    results: list[dict[str, Any]] = [{} for _ in cases]
    # A hang guard sized for a slow machine: all cases wait on one engine together.
    async with srv.client(limits=httpx.Limits(max_connections=64), timeout=600.0) as c:

        async def one(i: int, case: dict[str, Any]) -> None:
            if "logprobs" in case:
                results[i] = await _completion(c, case)
                return
            body = {**case, "ignore_eos": True}
            if i % 2:
                r = await c.post("/v1/generate", json=body)
                assert r.status_code == 200, r.text
                results[i] = {**r.json(), "streamed_ids": None}
                return
            streamed: list[int] = []
            done: dict[str, Any] = {}
            async with c.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                event = ""
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = orjson.loads(line[6:])
                        if event == "token":
                            streamed.extend(data["token_ids"])
                        elif event == "done":
                            done = data
            results[i] = {**done, "token_ids": streamed, "streamed_ids": streamed}

        async with trio.open_nursery() as n:
            for i, case in enumerate(cases):
                n.start_soon(one, i, case)
    return results


def _direct(
    model: Path, cases: list[dict[str, Any]], tmp_path: Path, kv_dtype: str = "auto"
) -> list[dict[str, Any]]:
    cases_file = tmp_path / "cases.json"
    cases_file.write_bytes(orjson.dumps(cases))
    script = Path(__file__).parent / "fidelity_engine.py"
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(cases_file), "256", "2", kv_dtype],
        capture_output=True,
        timeout=600,
        check=True,
    )
    out: list[dict[str, Any]] = orjson.loads(done.stdout)
    return out


async def _check(
    model: Path, tmp_path: Path, cases: list[dict[str, Any]], **extra: Any
) -> list[dict[str, Any]]:
    """The cases over HTTP (the server given `extra` settings) against the engine alone
    in another process; the server's request log."""
    # All cases at once wait in the queue: a deadline no machine, however slow, reaches
    # (this test is about tokens; deadlines are tested elsewhere). The server keeps its
    # prefix cache (which prompt finds which in it depends on timing over HTTP) and the
    # direct run has none: a prompt served from the cache gets the bits it gets computed
    # whole (docs/engine.md, "Prefix cache"), which the logprobs check.
    settings = {"max_concurrency": 8, "max_pending_requests": 64, "pending_timeout_ms": 600_000,
                "served_model_name": [MODEL_NAME], **extra}  # fmt: skip
    async with serve(model, tmp_path, **settings) as srv:
        http = await _over_http(srv, cases)
        async with srv.client() as c:
            props = (await c.get("/props")).json()
            metrics = (await c.get("/metrics")).text
        log = srv.log_records()
    assert props["speculative"] == extra.get("spec", "none")
    assert "ninfer_spec_decode_num_accepted_tokens_total" in metrics
    kv_dtype = extra.get("kv_dtype", "auto")  # the engine alone stores its cache alike
    direct = await trio.to_thread.run_sync(_direct, model, cases, tmp_path, kv_dtype)
    assert len(http) == len(direct) == len(cases)
    mismatches = [
        (case["prompt"], case.get("seed"), case.get("logprobs"))
        for case, h, d in zip(cases, http, direct, strict=True)
        if h["token_ids"] not in (None, d["token_ids"]) or _logprobs_differ(h, d)
    ]
    detail = [
        (h.get("logprobs"), d.get("logprobs"))
        for case, h, d in zip(cases, http, direct, strict=True)
        if (case["prompt"], case.get("seed"), case.get("logprobs")) in mismatches[:1]
    ]
    assert mismatches == [], (
        f"{len(mismatches)} of {len(cases)} differ: {mismatches[:5]}; first: {detail}"
    )
    for case, h, d in zip(cases, http, direct, strict=True):
        # Usage against independent counts: the other process's tokenization of the
        # prompt, and the tokens as they arrived over the wire.
        assert h["usage"]["prompt_tokens"] == len(d["prompt_ids"])
        assert h["usage"]["completion_tokens"] == case["max_new_tokens"]
        assert h["token_ids"] is None or len(h["token_ids"]) == case["max_new_tokens"]
        assert h["usage"]["total_tokens"] == len(d["prompt_ids"]) + case["max_new_tokens"]
    return log


def _logprobs_differ(http: dict[str, Any], direct: dict[str, Any]) -> bool:
    """Whether the logprobs over HTTP (values, and each place's alternatives) differ
    from the engine's alone, bit for bit (compared by value: the wire names tokens by
    their text)."""
    if "logprobs" not in http:
        return False
    values, tops = http["logprobs"]
    alone = direct["logprobs"]
    if values != [v for v, _ in alone] or len(tops) != len(alone):
        return True
    # Alternatives that spell the same text (parts of one UTF-8 character, say) share
    # one key on the wire, the last one's value kept: each place's values must be among
    # the engine's.
    return any(
        not set(t.values()) <= {lp for _, lp in top}
        for t, (_, top) in zip(tops, alone, strict=True)
    )


async def test_http_equals_the_engine_in_another_process(tiny_gguf: Path, tmp_path: Path) -> None:
    await _check(tiny_gguf, tmp_path, _cases(max_new_tokens=24, seeded=True))


async def test_http_equals_the_engine_with_speculation(tiny_gguf: Path, tmp_path: Path) -> None:
    """With --spec ngram the server's tokens and logprobs, batched, greedy and seeded,
    are still those of the engine alone without speculation; the constrained rows'
    grammars draft what they force, and the request log counts it."""
    log = await _check(tiny_gguf, tmp_path, _cases(max_new_tokens=24, seeded=True, every=2),
                       spec="ngram", draft_tokens=4)  # fmt: skip
    done = [r for r in log if r["event"] == "request_done"]
    counts = [r["speculative"] for r in done]
    assert all(c["backend"] == "ngram" and c["draft_window"] == 4 for c in counts)
    assert sum(c["accepted_tokens"] for c in counts) > 0
    assert sum(c["drafted_tokens"] for c in counts) >= sum(c["accepted_tokens"] for c in counts)


async def test_http_equals_the_engine_with_an_int8_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    """--kv-dtype int8 quantizes each position's head row on its own: a row's keys are the
    same in any batch, so batched answers over HTTP still equal the engine alone (with
    the same cache), token for token and logprob for logprob."""
    log = await _check(tiny_gguf, tmp_path, _cases(max_new_tokens=24, seeded=True, every=2),
                       kv_dtype="int8")  # fmt: skip
    (start,) = [r for r in log if r["event"] == "server_start"]
    assert start["engine"]["kv_sizing"]["kv_dtype"] == "int8"


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma3"])
async def test_http_equals_the_engine_for_each_family(tmp_path: Path, architecture: str) -> None:
    """Batch invariance holds for the other architectures of the family too (biases,
    per-head norms and Gemma's post-norms are per row; its sliding window is a mask per
    row): every third prompt, batched over HTTP. Gemma's six layers include a global one,
    and its SentencePiece vocabulary goes through the same streams and stop strings."""
    from tinymodel import write_tiny_gguf

    model = write_tiny_gguf(
        tmp_path / f"{architecture}.gguf",
        architecture=architecture,
        n_layers=6 if architecture == "gemma3" else 2,
    )
    await _check(model, tmp_path, _cases(max_new_tokens=12, seeded=True, every=3))


async def test_http_equals_the_engine_with_prompts_prefilled_together(tmp_path: Path) -> None:
    """A model whose layer matrices all run through the int4 kernel (as a Q4 model's
    do) has waiting prompts prefilled together, in one pass: each gets exactly the
    numbers it gets prefilled alone (the direct run prefills one at a time)."""
    from tinymodel import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "packed.gguf", packed_layers=True)
    await _check(model, tmp_path, _cases(max_new_tokens=12, seeded=True, every=2))


@pytest.mark.realmodel
async def test_http_equals_the_engine_with_the_default_model(
    real_gguf: Path, tmp_path: Path
) -> None:
    # Every other prompt (33 requests, batched over HTTP): the tiny model's test above
    # takes them all; this one is about the real weights.
    await _check(real_gguf, tmp_path, _cases(max_new_tokens=8, seeded=True, every=2))
