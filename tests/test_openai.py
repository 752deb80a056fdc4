"""The OpenAI-compatible routes, driven by the official openai SDK: in-process over the
tiny model's real engine, and the default model over a real socket."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio
from server import serve, serve_model


async def test_models(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-test-llama"]
        assert (await client.models.retrieve("tiny-test-llama")).id == "tiny-test-llama"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")


async def test_chat_completion_matches_the_native_route(tiny_gguf: Path, tmp_path: Path) -> None:
    """The same greedy request through OpenAI chat and the native route: the same tokens."""
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny-test-llama",
            messages=[{"role": "user", "content": "the cat"}],
            max_completion_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        chat = raw.parse()
        assert raw.headers["x-request-id"]
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 12
        assert chat.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        template = srv.app.lifespan.model.tokenizer.chat_template  # type: ignore[union-attr]
        assert template is not None
        prompt = template.render([{"role": "user", "content": "the cat"}])
        assert chat.usage.prompt_tokens == len(srv.app.lifespan.model.tokenizer.encode(prompt))  # type: ignore[union-attr]
        async with srv.client() as c:
            native = (
                await c.post(
                    "/v1/generate",
                    json={
                        "prompt": prompt,
                        "max_new_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
            ).json()
        assert chat.choices[0].message.content == native["text"]


async def test_chat_streaming_with_usage(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client:
        kwargs = {
            "model": "tiny-test-llama",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
            "max_tokens": 10,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        whole = await client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 10


async def test_text_completions(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client:
        c = await client.completions.create(
            model="tiny-test-llama", prompt="the", max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert c.choices[0].finish_reason == "length"
        assert c.usage is not None
        assert c.usage.completion_tokens == 5
        stream = await client.completions.create(
            model="tiny-test-llama", prompt="the", max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        assert text == c.choices[0].text


async def test_errors_map_to_the_sdk_classes(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, api_key="k") as srv:
        async with srv.openai("nope") as bad_key:
            with pytest.raises(openai.AuthenticationError):
                await bad_key.models.list()
        client = srv.openai("k")
        await _errors(client)
        await client.close()


async def _errors(client: openai.AsyncOpenAI) -> None:
    """Each refusal reaches the SDK as its own exception class, naming the parameter."""
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="gpt-4o", messages=msgs)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny-test-llama", messages=msgs, n=99)  # type: ignore[arg-type]
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="tiny-test-llama",
            messages=msgs,
            extra_body={"frobnicate": 1},  # type: ignore[arg-type]
        )
    assert (e.value.param, e.value.code) == ("frobnicate", "unknown_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="tiny-test-llama", messages=msgs,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )  # fmt: skip
    assert e.value.param == "tool_choice.function.name"


async def test_overload_is_a_rate_limit_error(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve_model(tiny_gguf, tmp_path, max_concurrency=1, max_pending_requests=0) as srv,
        srv.openai() as client,
    ):
        results: list[str] = []
        async with trio.open_nursery() as n:

            async def one() -> None:
                try:
                    await client.completions.create(
                        model="tiny-test-llama", prompt="x", max_tokens=200,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    results.append("ok")
                except openai.RateLimitError:
                    results.append("429")

            for _ in range(4):
                n.start_soon(one)
        assert "429" in results
        assert "ok" in results


async def test_cors_preflight_and_headers(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve_model(tiny_gguf, tmp_path, cors=True, api_key="k") as srv,
        srv.client() as c,
    ):
        pre = await c.options(
            "/v1/chat/completions",
            headers={"origin": "http://x", "access-control-request-method": "POST"},
        )
        assert pre.status_code == 204, "preflight needs no key"
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = await c.get("/v1/models", headers={"authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "*"
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        r = await c.get("/v1/models")
        assert "access-control-allow-origin" not in r.headers
    # --cors ORIGINS: only those origins are allowed, each echoed back with Vary
    origins = "https://app.example, http://localhost:5173/"
    async with (
        serve_model(tiny_gguf, tmp_path, cors=origins) as srv,
        srv.client() as c,
    ):
        for origin, allowed in (
            ("http://localhost:5173", True),
            ("https://app.example", True),
            ("https://evil.example", False),
        ):
            pre = await c.options(
                "/v1/chat/completions",
                headers={"origin": origin, "access-control-request-method": "POST"},
            )
            r = await c.get("/v1/models", headers={"origin": origin})
            for answer in (pre, r):
                if allowed:
                    assert answer.headers["access-control-allow-origin"] == origin
                    assert "origin" in answer.headers["vary"].lower().split(", ")
                else:
                    assert "access-control-allow-origin" not in answer.headers


@pytest.mark.realmodel
async def test_real_model_through_the_sync_openai_sdk(real_gguf: Path, tmp_path: Path) -> None:
    """The default model end to end over a real socket, with the synchronous SDK."""
    async with serve(real_gguf, tmp_path) as srv:

        def ask() -> str:
            with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
                reply = client.chat.completions.create(
                    model=client.models.list().data[0].id,
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    temperature=0,
                    max_completion_tokens=32,
                )
                assert reply.choices[0].finish_reason == "stop"
                return reply.choices[0].message.content or ""

        text = await trio.to_thread.run_sync(ask)
        assert text.startswith("The capital of France is Paris.")


@pytest.mark.realmodel
async def test_a_registered_model_is_served_under_its_name_alone(
    real_gguf: Path, tmp_path: Path
) -> None:
    """Served by its registered name, the default model is listed and answered under
    that name only: not also under its file's id (smollm2-135m-8k-lc100k-mix1-ep2),
    which newcomers could not place."""
    from ninfer._artifacts import DEFAULT_MODEL

    async with serve(Path(DEFAULT_MODEL), tmp_path) as srv, srv.client() as c:
        models = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [DEFAULT_MODEL]
        assert srv.app.lifespan.serving is not None
        file_id = srv.app.lifespan.serving.model.identity.model_id
        assert file_id != DEFAULT_MODEL
        body = {"model": file_id, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}  # fmt: skip
        r = await c.post("/v1/chat/completions", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


async def test_stop_strings_on_the_openai_routes(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.openai() as client:
        base = {"model": "tiny-test-llama", "prompt": "and", "max_tokens": 40, "temperature": 0}
        full = (
            (await client.completions.create(**base, extra_body={"ignore_eos": True}))
            .choices[0]
            .text
        )  # type: ignore[call-overload]
        stop = full[5:8]
        c = await client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        assert c.choices[0].finish_reason == "stop"
        assert c.choices[0].text == full[: full.index(stop)]
