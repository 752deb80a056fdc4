"""The Anthropic-compatible routes, driven by the official anthropic SDK against a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
from server import serve_app, serve_model

# Every name the tests give as `model` is served (aliases of the one model).
NAMES = ["m", "any-label", "x"]


async def test_messages_whole_and_streamed(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv,
        srv.anthropic() as client,
    ):
        kwargs = {
            "model": "any-label",
            "max_tokens": 9,
            "system": "be brief",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}],
            # The 2.x SDK no longer has a temperature argument; older clients send it.
            "extra_body": {"temperature": 0},
        }
        msg = await client.messages.create(**kwargs)  # type: ignore[call-overload]
        assert msg.model == "any-label"
        assert msg.stop_reason in ("max_tokens", "end_turn")
        assert msg.usage.output_tokens <= 9
        template = srv.app.lifespan.model.tokenizer.chat_template  # type: ignore[union-attr]
        prompt = template.render(  # type: ignore[union-attr]
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
        )
        n_prompt = len(srv.app.lifespan.model.tokenizer.encode(prompt))  # type: ignore[union-attr]
        assert msg.usage.input_tokens == n_prompt
        count = await client.messages.count_tokens(
            model="x", system="be brief", messages=[{"role": "user", "content": "the cat"}]
        )
        assert count.input_tokens == n_prompt
        async with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
            events = [e.type async for e in stream]
            final = await stream.get_final_message()
        assert events[0] == "message_start"
        assert "content_block_start" in events
        assert events[-1] == "message_stop"
        assert final.content[0].text == msg.content[0].text  # type: ignore[union-attr]
        assert final.stop_reason == msg.stop_reason
        async with srv.client() as c:
            native = (
                await c.post(
                    "/v1/generate",
                    json={"prompt": prompt, "max_new_tokens": 9, "temperature": 0},
                )
            ).json()
        assert msg.content[0].text == native["text"]  # type: ignore[union-attr]


async def test_stop_sequence(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv,
        srv.anthropic() as client,
    ):
        base = {
            "model": "m",
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "and"}],
            "extra_body": {"temperature": 0},
        }
        full = (await client.messages.create(**base)).content[0].text  # type: ignore[call-overload,union-attr]
        if len(full) < 8:
            pytest.skip("the random model ended its turn too early for this prompt")
        stop = full[4:7]
        msg = await client.messages.create(**base, stop_sequences=[stop])  # type: ignore[call-overload]
        assert msg.stop_reason == "stop_sequence"
        assert msg.stop_sequence == stop
        assert msg.content[0].text == full[: full.index(stop)]


async def test_errors_map_to_the_sdk_classes(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, api_key="k", served_model_name=NAMES) as srv:
        msgs = [{"role": "user", "content": "x"}]
        async with srv.anthropic("wrong") as bad:
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(model="m", max_tokens=5, messages=msgs)  # type: ignore[arg-type]
        async with srv.anthropic("k") as client:
            image = {"type": "base64", "media_type": "image/png", "data": "AA=="}
            with pytest.raises(anthropic.BadRequestError) as e:
                await client.messages.create(
                    model="m",
                    max_tokens=5,
                    messages=[
                        {"role": "user", "content": [{"type": "image", "source": image}]}  # type: ignore[list-item]
                    ],
                )
            assert "image" in str(e.value)
            with pytest.raises(anthropic.BadRequestError):
                await client.messages.create(
                    model="m", max_tokens=5, messages=msgs,  # type: ignore[arg-type]
                    thinking={"type": "enabled", "budget_tokens": 1024},
                )  # fmt: skip
            r = await client.messages.with_raw_response.create(
                model="m",
                max_tokens=2,
                messages=msgs,  # type: ignore[arg-type]
            )
            assert r.headers["request-id"]
            async with srv.client() as c:
                raw = await c.post(
                    "/v1/messages", json={"max_tokens": 5}, headers={"x-api-key": "k"}
                )
                # No `param` in Anthropic's envelope: the message names the field, once.
                named = await c.post("/v1/messages", headers={"x-api-key": "k"}, json={
                    "model": "m", "max_tokens": 5, "messages": msgs,
                    "stop_sequences": ["a", ""]})  # fmt: skip
            message = named.json()["error"]["message"]
            assert message == "stop_sequences[1]: must be a non-empty string"
            body = raw.json()
            assert raw.status_code == 400
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
            assert body["request_id"] == raw.headers["request-id"]


async def test_huge_prompts_are_refused_before_tokenizing(tiny_gguf: Path, tmp_path: Path) -> None:
    """A 3 MB text cannot fit the context: it is refused (400 context_length_exceeded)
    without being tokenized whole, on every route, while /health keeps answering."""
    huge = "lorem ipsum " * 250_000
    messages = [{"role": "user", "content": huge}]
    async with serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv, srv.client() as c:
        for path, body in (
            ("/v1/messages/count_tokens", {"model": "m", "messages": messages}),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": messages}),
            ("/v1/completions", {"model": srv.app.lifespan.public_id, "prompt": huge}),
            ("/v1/generate", {"prompt": huge}),
        ):
            r = await c.post(path, json=body)
            assert r.status_code in (400, 422), (path, r.text)
            assert "context" in r.text
            assert (await c.get("/health")).status_code == 200


async def test_token_counting_has_a_limit_of_its_own(tiny_gguf: Path, tmp_path: Path) -> None:
    """Counts take no place in the scheduler; past their own limit they get 429 at once."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    async with serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv, srv.client() as c:
        holders = [object() for _ in range(int(srv.app.counting.total_tokens))]
        for h in holders:
            srv.app.counting.acquire_on_behalf_of_nowait(h)
        r = await c.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        for h in holders:
            srv.app.counting.release_on_behalf_of(h)
        r = await c.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200


async def test_large_bodies_are_read_and_rendered_off_the_event_loop(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over 64 KiB is decoded and checked, and a conversation over 64 turns
    rendered, on a worker thread, on every chat route: 60,000 messages once held the
    event loop (and /health, and every stream) for seconds. Small ones stay inline."""
    import threading

    from ninfer.frontends import _base

    where: list[tuple[str, int, bool]] = []  # (what, size, on the event loop's thread)
    real_loads, real_render = _base.loads, _base.Frontend.render_template

    def loads(body: bytes) -> Any:
        where.append(("body", len(body), threading.current_thread() is threading.main_thread()))
        return real_loads(body)

    def render(self: Any, conversation: list[Any], **kw: Any) -> Any:
        on_loop = threading.current_thread() is threading.main_thread()
        where.append(("turns", len(conversation), on_loop))
        return real_render(self, conversation, **kw)

    monkeypatch.setattr(_base, "loads", loads)
    monkeypatch.setattr(_base.Frontend, "render_template", render)
    many = [{"role": ("user", "assistant")[i % 2], "content": "word " * 20} for i in range(1001)]
    async with serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv, srv.client() as c:
        for path, body in (
            ("/v1/messages/count_tokens", {"model": "m", "messages": many}),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": many}),
            ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": many}),
            ("/v1/responses", {"model": "m", "max_output_tokens": 16, "input": many}),
            ("/v1/messages/count_tokens", {"model": "m", "messages": many[:1]}),
        ):
            r = await c.post(path, json=body)
            assert r.status_code in (200, 400), (path, r.text)  # 400: past the context
    bodies = [(size, on_loop) for what, size, on_loop in where if what == "body"]
    turns = [(size, on_loop) for what, size, on_loop in where if what == "turns"]
    assert len(bodies) == 5
    assert len(turns) >= 4
    assert all(on_loop == (size <= _base.INLINE_BODY_BYTES) for size, on_loop in bodies)
    assert all(on_loop == (size <= _base.INLINE_TURNS) for size, on_loop in turns)
    assert any(on_loop for _, on_loop in bodies)
    assert any(on_loop for _, on_loop in turns)


_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                           "input": {}}]}  # fmt: skip
_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
_DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}}  # fmt: skip


def _result(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "q"}, _CALL, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": list(blocks)}]}]  # fmt: skip


@pytest.mark.parametrize(
    ("blocks", "param", "message"),
    [
        ([{"type": "foo", "text": "x"}], "messages[2].content[0].content[0].type",
         "content blocks of this type are not supported in a tool_result here; text blocks are"),
        ([{"type": "text", "text": "ok"}, {"type": "image"}],
         "messages[2].content[0].content[1].type",
         "content blocks of 'image' are not supported in a tool_result here; text blocks are"),
        ([_IMAGE], "messages[2].content[0].content[0].type",
         "content blocks of 'image' are not supported in a tool_result here; text blocks are"),
        ([_DOCUMENT], "messages[2].content[0].content[0].type",
         "content blocks of 'document' are not supported in a tool_result here; text blocks are"),
        ([{"type": "text"}], "messages[2].content[0].content[0].text",
         "a text block needs its text"),
    ],
)  # fmt: skip
async def test_a_tool_results_blocks_are_checked_as_top_level_ones_are(
    tmp_path: Path, blocks: list[dict[str, Any]], param: str, message: str
) -> None:
    body = {"model": "fake", "max_tokens": 4, "messages": _result(*blocks)}
    async with serve_app(tmp_path) as srv, srv.client() as c:
        r = await c.post("/v1/messages", json=body)
        text = {"type": "text", "text": "sunny", "cache_control": {"type": "ephemeral"}}
        ok = await c.post("/v1/messages", json={**body, "messages": _result(text)})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"type": "invalid_request_error", "message": f"{param}: {message}"}
    assert ok.status_code == 200, ok.text
