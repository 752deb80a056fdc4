"""What popular clients send by default is served: prompt arrays, large max_tokens,
the standard fields of the OpenAI references, log probabilities, n > 1, Anthropic's
cache accounting, model aliases, paths without /v1 and OpenAI's 401. Driven through
the official openai and anthropic SDKs against a real server where a client sends it."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import ANY

import anthropic
import httpx
import openai
import pytest
import trio
import trio.testing
from fakeengine import FakeEngine, request
from server import running_app, serve, wait_for

MODEL = "tiny-test-llama"
# Names tools default to, served as aliases of the one model.
ALIASES = [MODEL, "gpt-4o-mini", "claude-local"]


def _openai(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _anthropic(url: str, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def test_prompt_arrays_give_one_choice_per_prompt(tiny_gguf: Path, tmp_path: Path) -> None:
    """langchain-openai's OpenAI LLM sends `prompt: [...]`; token ids work too."""
    prompts = ["the cat sat", "a dog ran far"]
    async with serve(tiny_gguf, tmp_path) as srv, _openai(srv.url) as client:
        greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0}
        alone = [await client.completions.create(prompt=p, **greedy) for p in prompts]
        both = await client.completions.create(prompt=prompts, **greedy)
        assert [c.index for c in both.choices] == [0, 1]
        assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
        assert both.usage is not None
        assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
        tok = srv.app.lifespan.model.tokenizer  # type: ignore[union-attr]
        ids = [tok.encode(p) for p in prompts]
        one_by_ids = await client.completions.create(prompt=ids[0], **greedy)
        assert one_by_ids.choices[0].text == alone[0].choices[0].text
        by_ids = await client.completions.create(prompt=ids, **greedy)
        assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(prompt=[[1, 2], [10**6]], **greedy)
        assert e.value.param == "prompt[1]"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(prompt=["x"] * 9, **greedy)  # 9 > 8 sequences
        assert e.value.param == "prompt"


async def test_n_choices_are_decoded_together(tiny_gguf: Path, tmp_path: Path) -> None:
    """n > 1: one choice per sequence; a seeded request's k-th choice is the same request
    alone with seed + k; usage counts the prompt once; the copies share its pages."""
    msgs = [{"role": "user", "content": "tell me a long story about the cat and the dog"}]
    async with serve(tiny_gguf, tmp_path) as srv, _openai(srv.url) as client:
        greedy = await client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            temperature=0,
            n=3,  # type: ignore[arg-type]
        )
        assert [c.index for c in greedy.choices] == [0, 1, 2]
        assert len({c.message.content for c in greedy.choices}) == 1
        one = await client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        assert greedy.usage is not None
        assert one.usage is not None
        assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
        assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
        before = srv.app.lifespan.service.statistics()
        seeded: dict[str, Any] = {
            "model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 1.0,
            "extra_body": {"ignore_eos": True},
        }  # fmt: skip
        two = await client.chat.completions.create(n=2, seed=7, **seeded)
        after = srv.app.lifespan.service.statistics()
        assert before is not None
        assert after is not None
        # The second copy shares the first's full prompt pages (the prefix cache).
        assert after.cached_prompt_tokens - before.cached_prompt_tokens >= 16
        second = await client.chat.completions.create(seed=8, **seeded)
        assert two.choices[1].message.content == second.choices[0].message.content
        texts: dict[int, str] = {0: "", 1: ""}
        finished: dict[int, str | None] = {}
        stream = await client.chat.completions.create(n=2, seed=7, stream=True, **seeded)
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    finished[c.index] = c.finish_reason
        assert texts == {c.index: c.message.content for c in two.choices}
        assert finished == {0: "length", 1: "length"}


async def test_max_tokens_past_the_context_is_clamped_and_said(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """litellm sends 128000, pydantic-ai 16384: served up to what the context leaves, with
    a header that says so; the native route stays strict."""
    async with (
        serve(tiny_gguf, tmp_path, served_model_name=ALIASES) as srv,
        _openai(srv.url) as oa,
        _anthropic(srv.url) as an,
    ):
        msgs: Any = [{"role": "user", "content": "hello"}]
        raw = await oa.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, max_completion_tokens=16384, temperature=0
        )
        chat = raw.parse()
        assert chat.usage is not None
        granted = int(raw.headers["x-ninfer-max-tokens-clamped"])
        assert granted == 512 - chat.usage.prompt_tokens  # the tiny model's context
        assert chat.choices[0].finish_reason in ("stop", "length")
        # (With so large a budget the SDK insists on a timeout of the caller's own.)
        raw_msg = await an.messages.with_raw_response.create(
            model="claude-local", max_tokens=128000, messages=msgs, timeout=120
        )
        msg = await raw_msg.parse()
        assert msg.stop_reason in ("end_turn", "max_tokens")
        assert int(raw_msg.headers["x-ninfer-max-tokens-clamped"]) < 512
        small = await oa.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, max_completion_tokens=3
        )
        assert "x-ninfer-max-tokens-clamped" not in small.headers
        async with srv.client() as c:
            r = await c.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 16384})
        assert r.status_code == 422
        assert r.json()["error"]["type"] == "context_length_exceeded"


async def test_clamped_requests_do_not_monopolise_the_pool(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Four clients sending max_tokens 16384 against a pool of one context (32 pages):
    each reserves its prompt and --default-max-tokens, not the whole context, so all
    four decode at once instead of one after another."""
    engine = FakeEngine(step_s=0.01, max_context=512, kv_pages=32)
    settings = {"max_concurrency": 4, "default_max_tokens": 16}
    async with running_app(tmp_path, engine, **settings) as app, trio.open_nursery() as n:
        body = {"model": "fake", "max_tokens": 16384,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        for _ in range(4):
            n.start_soon(request, app, "POST", "/v1/chat/completions", body)
        assert app.lifespan.scheduler is not None
        scheduler = app.lifespan.scheduler
        await wait_for(lambda: scheduler.statistics().running == 4)
        stats = scheduler.statistics()
        assert stats.waiting == 0
        assert stats.units_used == 4 * 3  # prompt and 16 reserved tokens: 3 pages each
        n.cancel_scope.cancel()


async def test_standard_openai_fields_are_known_by_name(tiny_gguf: Path, tmp_path: Path) -> None:
    """Fields the SDKs and agents send by default are honoured or accepted; the rest
    are refused as unsupported_parameter, naming the field, never unknown_parameter."""
    msgs: Any = [{"role": "user", "content": "hello"}]
    async with serve(tiny_gguf, tmp_path) as srv, _openai(srv.url) as client:
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=3,
            store=True,
            metadata={"user": "u1"},
            service_tier="auto",
            prompt_cache_key="k",
            safety_identifier="s",
            modalities=["text"],
            parallel_tool_calls=True,
            user="me",
        )
        assert chat.service_tier == "default"
        stream = await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )  # fmt: skip
        assert [c async for c in stream][-1].usage is not None
        refused: list[tuple[dict[str, Any], str]] = [
            ({"reasoning_effort": "low"}, "reasoning_effort"),
            ({"verbosity": "low"}, "verbosity"),
            ({"modalities": ["text", "audio"]}, "modalities[1]"),
            ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
            ({"web_search_options": {}}, "web_search_options"),
            ({"functions": [{"name": "f"}]}, "functions"),
            ({"function_call": "auto"}, "function_call"),
            ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ]  # fmt: skip
        for fields, param in refused:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=2, extra_body=fields
                )
            assert (e.value.param, e.value.code) == (param, "unsupported_parameter"), fields
        for fields, param in (({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")):
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(
                    model=MODEL, prompt="x", max_tokens=2, extra_body=fields
                )
            assert (e.value.param, e.value.code) == (param, "unsupported_parameter")
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model=MODEL, messages=msgs, metadata={f"k{i}": "v" for i in range(17)}
            )
        assert e.value.param == "metadata"


async def test_logit_bias_steers_the_logits(tiny_gguf: Path, tmp_path: Path) -> None:
    """+100 all but forces a token, -100 bans it (read back through logprobs' bytes)."""
    async with serve(tiny_gguf, tmp_path) as srv, _openai(srv.url) as client:
        greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                  "messages": [{"role": "user", "content": "the cat"}],
                                  "logprobs": True, "extra_body": {"ignore_eos": True}}  # fmt: skip

        async def spelled(**extra: Any) -> list[bytes]:
            done = await client.chat.completions.create(**greedy, **extra)
            lps = done.choices[0].logprobs
            assert lps is not None
            assert lps.content is not None
            return [bytes(e.bytes or []) for e in lps.content]

        tok = srv.app.lifespan.model.tokenizer  # type: ignore[union-attr]
        forced = tok.encode(" dog")[0]
        assert await spelled(logit_bias={str(forced): 100}) == [tok.token_bytes(forced)] * 4
        first = (await spelled())[0]
        first_id = tok.spellings.index(first)
        assert (await spelled(logit_bias={str(first_id): -100}))[0] != first
        with pytest.raises(openai.BadRequestError) as e:
            await spelled(logit_bias={"99999": 1})
        assert e.value.param == "logit_bias"


async def test_logprobs_whole_and_streamed(tiny_gguf: Path, tmp_path: Path) -> None:
    msgs: Any = [{"role": "user", "content": "hello there"}]
    async with serve(tiny_gguf, tmp_path) as srv, _openai(srv.url) as client:
        args: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 6,
                                "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
        # Served once first, so that both requests below take the prompt's full pages
        # from the prefix cache alike (docs/engine.md, "A known gap").
        await client.chat.completions.create(**{**args, "max_tokens": 1})
        whole = await client.chat.completions.create(**args)
        lps = whole.choices[0].logprobs
        assert lps is not None
        assert lps.content is not None
        assert whole.usage is not None
        eos = whole.choices[0].finish_reason == "stop"
        assert len(lps.content) == whole.usage.completion_tokens - eos
        for entry in lps.content:
            assert len(entry.top_logprobs) == 3
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            assert entry.logprob == values[0]  # greedy: the chosen token is the likeliest
            assert entry.logprob <= 0.0
        text = b"".join(bytes(e.bytes or []) for e in lps.content).decode(errors="replace")
        assert text == whole.choices[0].message.content
        streamed = []
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.content:
                    streamed.extend(c.logprobs.content)
        assert [(e.token, e.logprob) for e in streamed] == [
            (e.token, e.logprob) for e in lps.content
        ]
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(**{**args, "top_logprobs": 21})
        assert e.value.param == "top_logprobs"
        # Completions: echo with logprobs scores the prompt too (its first token has none).
        prompt = "the cat sat on the mat"
        echo = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
        )
        choice = echo.choices[0]
        assert choice.text.startswith(prompt)
        assert choice.logprobs is not None
        tok = srv.app.lifespan.model.tokenizer  # type: ignore[union-attr]
        n_prompt = len(tok.encode(prompt))
        values = choice.logprobs.token_logprobs or []
        assert values[0] is None
        assert all(v is not None for v in values[1:])
        assert len(values) == n_prompt + 3 - (choice.finish_reason == "stop")
        if "\ufffd" not in choice.text:  # random weights may end mid-character
            assert "".join(choice.logprobs.tokens or []) == choice.text
        offsets = choice.logprobs.text_offset or []
        assert offsets == sorted(offsets)
        assert offsets[n_prompt] == len(prompt)
        chunks = [c async for c in await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
            stream=True)]  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


async def test_anthropic_usage_reports_the_prefix_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    """cache_read_input_tokens counts prompt tokens served from the prefix cache, and
    input_tokens excludes them, in the body and in message_start / message_delta."""
    long = "the cat sat on the mat and looked at the dog " * 4
    msgs: Any = [{"role": "user", "content": long}]
    async with (
        serve(tiny_gguf, tmp_path, served_model_name=ALIASES) as srv,
        _anthropic(srv.url) as client,
    ):
        first = await client.messages.create(model="claude-local", max_tokens=2, messages=msgs)
        u = first.usage
        assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (0, 0)
        total = u.input_tokens
        again = await client.messages.create(model="claude-local", max_tokens=2, messages=msgs)
        cached = again.usage.cache_read_input_tokens
        assert cached is not None
        assert cached >= 16
        assert again.usage.input_tokens == total - cached
        async with client.messages.stream(
            model="claude-local", max_tokens=2, messages=msgs
        ) as stream:
            events = [e async for e in stream]
        start = next(e for e in events if e.type == "message_start")
        assert start.message.usage.cache_read_input_tokens == cached  # type: ignore[union-attr]
        assert start.message.usage.input_tokens == total - cached  # type: ignore[union-attr]
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.usage.cache_read_input_tokens == cached  # type: ignore[union-attr]
    del srv


async def test_model_names_aliases_and_paths(tiny_gguf: Path, tmp_path: Path) -> None:
    """--served-model-name: the model is listed once with its other names as aliases,
    every name is answered as sent; any other is 404 on both dialects, naming what is
    served; paths without /v1 are the same routes."""
    async with serve(tiny_gguf, tmp_path, served_model_name=ALIASES) as srv:
        async with _openai(srv.url) as client:
            listed = [m async for m in client.models.list()]
            assert [m.id for m in listed] == ALIASES[:1]
            assert listed[0].model_extra == {"aliases": ALIASES[1:], "meta": ANY}
            chat = await client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert chat.model == "gpt-4o-mini"
            with pytest.raises(openai.NotFoundError) as e:
                await client.chat.completions.create(
                    model="gpt-5", messages=[{"role": "user", "content": "x"}]
                )
            assert "gpt-4o-mini" in e.value.message
            assert "gpt-5" not in e.value.message
        async with _anthropic(srv.url) as an:
            with pytest.raises(anthropic.NotFoundError) as ae:
                await an.messages.create(
                    model="claude-opus-9", max_tokens=2,
                    messages=[{"role": "user", "content": "x"}],
                )  # fmt: skip
            assert "claude-local" in str(ae.value)
        # A client configured without /v1 (base URL is the server itself).
        bare = openai.AsyncOpenAI(base_url=srv.url, api_key="unused", max_retries=0)
        async with bare:
            assert [m.id async for m in bare.models.list()] == ALIASES[:1]
            done = await bare.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert done.choices[0].text is not None
            chat = await bare.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert chat.choices
        async with httpx.AsyncClient(base_url=srv.url) as c:
            r = await c.post("/messages", json={"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
            assert r.status_code == 200, r.text
            assert (await c.get(f"/models/{MODEL}")).json()["id"] == MODEL
    records = srv.log_path.read_text()
    assert '"endpoint":"/v1/messages"' in records  # logged as the route it is an alias of


async def test_a_bad_key_is_openais_invalid_api_key(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, api_key="k") as srv, _openai(srv.url, "nope") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            await c.models.list()
        body: Any = e.value.body
        assert body["type"] == "invalid_request_error"
        assert body["code"] == "invalid_api_key"


async def test_standard_anthropic_fields_are_known_by_name(tiny_gguf: Path, tmp_path: Path) -> None:
    msgs: Any = [{"role": "user", "content": "hello"}]
    async with (
        serve(tiny_gguf, tmp_path, served_model_name=ALIASES) as srv,
        _anthropic(srv.url) as client,
    ):
        done = await client.messages.create(
            model=MODEL, max_tokens=2, messages=msgs, service_tier="auto",
            extra_body={"cache_control": {"type": "ephemeral"}, "inference_geo": "us"},
        )  # fmt: skip
        assert done.type == "message"
        tool_result: Any = [
            {"role": "user", "content": "use the tool"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "failed", "is_error": True}]},
        ]  # fmt: skip
        # a tool_use and its (error) result in the history are taken
        replayed = await client.messages.create(model=MODEL, max_tokens=2, messages=tool_result)
        assert replayed.type == "message"
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(
                model=MODEL, max_tokens=2, messages=msgs,
                extra_body={"output_config": {"effort": "low"}},
            )  # fmt: skip
        assert "output_config" in str(e.value)
