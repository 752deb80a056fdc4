"""Embeddings: the engine's vectors against an independent float64 forward, the same
bits alone or in any batch, and beside decoding rows without changing their tokens."""

from __future__ import annotations

import array
from pathlib import Path

import numpy as np
import pytest
from conftest import RunningEngine
from reference_forward import reference_hidden

from ninfer._errors import RequestInvalid
from ninfer.engine import Embedding, EmbedSpec, GenerationRequest, Pooling


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(3 + (i * 11 + salt * 17) % 250 for i in range(n))


def _embed(
    rid: str, prompt: tuple[int, ...], pooling: Pooling = "mean", normalize: int = 2
) -> GenerationRequest:
    return GenerationRequest(rid, prompt, 0, embed=EmbedSpec(pooling, normalize))


def _vectors(e: Embedding | None) -> np.ndarray:
    assert e is not None
    values = array.array("f")
    values.frombytes(e.data)
    return np.asarray(values, dtype=np.float64).reshape(e.rows, e.dim)


def _expected(states: np.ndarray, pooling: Pooling, normalize: int) -> np.ndarray:
    """llama.cpp's pooling and common_embd_normalize, in float64."""
    if pooling == "none":
        return states
    v = {"mean": states.mean(axis=0), "cls": states[0], "last": states[-1]}[pooling]
    if normalize < 0:
        return v[None]
    total = (
        np.abs(v).max() / 32760.0
        if normalize == 0
        else (np.abs(v) ** normalize).sum() ** (1 / normalize)
    )
    return (v / total)[None]


@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [
        ("mean", 2),
        ("last", 2),
        ("cls", 2),
        ("none", 2),
        ("mean", -1),
        ("mean", 0),
        ("mean", 1),
        ("last", 3),
    ],
)
def test_vectors_match_the_float64_forward(
    tiny_engine: RunningEngine, tiny_gguf: Path, pooling: Pooling, normalize: int
) -> None:
    """Each pooling and normalization, over a prompt cut into several prefill passes
    (the fixture's --prefill-chunk is 8), against the reference forward's final-norm
    states pooled and normalized in float64."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    prompt = _prompt(29)
    h = eng.submit(_embed("e", prompt, pooling, normalize))
    (finish,) = sink.wait_done(h)
    assert finish.reason == "embedded"
    assert finish.usage.prompt_tokens == 29
    assert finish.usage.completion_tokens == 0
    assert h.id not in sink.tokens  # no token is sampled
    got = _vectors(finish.embedding)
    states, _head = reference_hidden(tiny_gguf, list(prompt))
    want = _expected(states, pooling, normalize)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-3 * scale
    if pooling != "none" and normalize == 2:
        assert abs(float(np.linalg.norm(got[0])) - 1.0) < 1e-5


def test_a_vector_is_the_same_alone_and_in_any_batch(tiny_engine: RunningEngine) -> None:
    """Each input's bytes alone equal its bytes when many inputs arrive together (and
    share prefill passes) while generation rows decode beside them (and their passes are
    cut to the streams' budget); the streams' tokens are those they get alone."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    inputs = [_prompt(3 + 7 * i, salt=i) for i in range(10)]
    alone = []
    for i, p in enumerate(inputs):
        h = eng.submit(_embed(f"a{i}", p, "mean"))
        alone.append(sink.wait_done(h)[0].embedding)
    gen = [
        GenerationRequest(f"g{i}", _prompt(9, salt=40 + i), 40, ignore_eos=True) for i in range(3)
    ]
    solo = []
    for r in gen:
        h = eng.submit(r)
        sink.wait_done(h)
        solo.append(sink.tokens[h.id])
    streams = [eng.submit(r) for r in gen]
    sink.wait_for(lambda: all(len(sink.tokens.get(s.id, [])) >= 2 for s in streams))
    together = [eng.submit(_embed(f"b{i}", p, "mean")) for i, p in enumerate(inputs)]
    finishes = sink.wait_done(*together)
    assert [f.embedding for f in finishes] == alone
    sink.wait_done(*streams)
    assert [sink.tokens[s.id] for s in streams] == solo


def test_pooling_none_gives_every_token_unnormalized(tiny_engine: RunningEngine) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    (finish,) = sink.wait_done(eng.submit(_embed("n", _prompt(12), "none")))
    got = _vectors(finish.embedding)
    assert got.shape[0] == 12
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)
    # Its last row is `last` pooling's vector before normalization.
    (last,) = sink.wait_done(eng.submit(_embed("l", _prompt(12), "last", -1)))
    assert np.array_equal(_vectors(last.embedding)[0], got[-1])


def test_an_embedding_request_takes_no_output_and_frees_its_pages(
    tiny_engine: RunningEngine,
) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    with pytest.raises(RequestInvalid):
        eng.submit(GenerationRequest("x", _prompt(5), 3, embed=EmbedSpec()))
    sink.wait_done(*(eng.submit(_embed(f"p{i}", _prompt(40, i))) for i in range(4)))
    assert eng.statistics().pages_used == 0


# ---- over HTTP: the routes, the SDK's default path, refusals, the log -------------------


async def test_the_openai_sdk_default_base64_path_gives_the_engines_vectors(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The openai SDK asks for base64 (its default) and decodes it: the vectors equal
    the float answer's and llama-server's /embedding's, in the inputs' order, with the
    usage of every input's tokens; the log has one request_start and one request_done
    of kind embedding, and /metrics counts the inputs."""
    from server import serve_model

    texts = ["the cat sat", "a dog ran far away", "the cat sat"]
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client, srv.client() as c:
        got = await client.embeddings.create(model="tiny-test-llama", input=texts)
        floats = (await c.post("/v1/embeddings", json={"input": texts})).json()
        llama = (await c.post("/embedding", json={"content": texts})).json()
        metrics = (await c.get("/metrics")).text
    vectors = [d.embedding for d in got.data]
    assert [d.index for d in got.data] == [0, 1, 2]
    want = [np.float32(d["embedding"]) for d in floats["data"]]
    assert all(np.array_equal(np.float32(v), w) for v, w in zip(vectors, want, strict=True))
    assert [np.float32(x["embedding"][0]).tolist() for x in llama] == [w.tolist() for w in want]
    assert vectors[0] == vectors[2]
    assert vectors[0] != vectors[1]
    assert got.usage.prompt_tokens == got.usage.total_tokens == floats["usage"]["prompt_tokens"]
    assert abs(float(np.linalg.norm(want[1])) - 1.0) < 1e-5
    records = [r for r in srv.log_records() if r.get("request_id") and "kind" in r]
    starts = [r for r in records if r["event"] == "request_start"]
    dones = [r for r in records if r["event"] == "request_done"]
    assert len(starts) == len(dones) == 3
    assert {(r["inputs"], r["pooling"], r["normalize"]) for r in starts} == {(3, "mean", 2)}
    assert {r["finish_reason"] for r in dones} == {"embedded"}
    assert "ninfer_embedding_inputs_total 9.0" in metrics


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/v1/embeddings", {"input": []}, 400, "input"),
        ("/v1/embeddings", {"input": True}, 400, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": 1}, 400, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ("/v1/embeddings", {"input": ["a", [5, 99999]]}, 400, "input[1]"),
        ("/v1/embeddings", {"input": ["a", "b " * 600]}, 400, "input[1]"),
        ("/v1/embeddings", {"input": "a", "dimensions": 3}, 400, "dimensions"),
        ("/v1/embeddings", {"input": "a", "pooling": "none"}, 400, "pooling"),
        ("/v1/embeddings", {"input": "a", "model": "text-embedding-3-small"}, 404, "model"),
        (
            "/v1/embeddings",
            {"input": "a", "truncate_prompt_tokens": 0},
            400,
            "truncate_prompt_tokens",
        ),
        ("/v1/embeddings", {"input": {"content": "string"}}, 400, "input.content"),
        (
            "/v1/embeddings",
            {"input": {"content": [{"type": "image_url"}]}},
            400,
            "input.content[0].type",
        ),
        ("/v1/embeddings", {"content": "a"}, 400, "input"),
        ("/embedding", {}, 422, "content"),
        ("/embedding", {"content": "a", "embd_normalize": 99}, 422, "embd_normalize"),
    ],
)
async def test_refusals_name_the_parameter(
    tiny_gguf: Path, tmp_path: Path, route: str, body: dict[str, object], status: int, param: str
) -> None:
    from server import serve_model

    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        r = await c.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "99999" not in err["message"]  # never an echo of the input


async def test_llama_server_input_shapes_and_truncation(tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-server's shapes: a mixed array is one input, objects with prompt_string or
    text parts are the same input as their text, pooling none gives a row a token; an
    input past the context is cut to its last tokens when asked."""
    from server import serve_model

    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:

        async def vec(route: str, **body: object) -> object:
            r = await c.post(route, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        plain = await vec("/v1/embeddings", input="hello world")
        text_parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
        parts = await vec(
            "/v1/embeddings", input=[{"content": text_parts}, {"prompt_string": "hello world"}]
        )
        assert [d["embedding"] for d in parts["data"]] == [plain["data"][0]["embedding"]] * 2
        mixed = await vec("/v1/embeddings", input=[12, 34, "hello", 56])
        assert len(mixed["data"]) == 1
        rows = await vec("/embeddings", content="hello hello hello", pooling="none")
        three = await vec("/v1/embeddings", input="hello hello hello")
        assert len(rows[0]["embedding"]) == three["usage"]["prompt_tokens"]
        cut = await vec("/v1/embeddings", input="b " * 600, truncate_prompt_tokens=-1)
        assert cut["usage"]["prompt_tokens"] == 512


async def test_an_embedding_request_is_admitted_like_a_generation(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """One place, none pending: while a stream holds it, an embedding request is refused
    at once with 429 and Retry-After (OpenAI's shape), and logged as rejected; once the
    stream has ended, the same request is served."""
    from server import serve

    body = {"input": ["one", "two"]}
    NO_PROMISE = {"x-ninfer-no-promise": "1"}
    async with (
        serve(tiny_gguf, tmp_path, max_concurrency=1, max_pending_requests=0) as srv,
        srv.client() as c,
    ):
        gen = {"prompt": "a b c", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=gen) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # it holds the place now
            # (no place promised to it: the next request may take the freed one)
            refused = await c.post("/v1/embeddings", json=body, headers=NO_PROMISE)
            async for _ in lines:  # to its end: its place is free before its last bytes
                pass
        assert refused.status_code == 429
        assert float(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["type"] == "rate_limit_error"  # OpenAI's, for a 429
        served = await c.post("/v1/embeddings", json=body)
        assert served.status_code == 200
    rejected = [r for r in srv.log_records() if r["event"] == "request_rejected"]
    assert [(r["endpoint"], r["status"]) for r in rejected] == [("/v1/embeddings", 429)]
