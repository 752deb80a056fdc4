"""Thinking modes: a chat template that can reason (Qwen 3's published template, in
tests/qwen3_chat_template.jinja) thinks by default; --no-thinking and each protocol's
switch turn it off or on; the reasoning reaches the client apart from the answer
(chat `reasoning_content`, Anthropic `thinking` blocks, Responses `reasoning` Items), and
a grammar (tools, structured outputs) starts after it.

The wire shapes run over a fake engine that writes a known output, one character a
token, behind the real app and a real socket (for the SDKs); the template, the grammar
and the real engine run on the tiny qwen3 file the suite writes."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import llguidance
import orjson
import pytest
import trio
from fakeengine import FakeEngine
from server import SERVER_HANG_GUARD_S, Server, serve
from tinymodel import write_tiny_gguf

from ninfer.engine import GenerationRequest, ThinkingSupport
from ninfer.engine._grammar import GrammarVocabulary, grammar_tokenizer
from ninfer.engine._loader import load_model
from ninfer.engine._tokenizer import ChatTemplate
from ninfer.frontends._output import OutputReader
from ninfer.frontends._reasoning import ReasoningPiece
from ninfer.frontends._structured import json_schema_grammar
from ninfer.frontends._tools import TextPiece, Tool, ToolPlan, tool_grammar

QWEN3 = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
# Later Qwen templates keep the reasoning of closed turns when asked: the same template
# with that switch.
QWEN3_PRESERVING = QWEN3.replace(
    "{%- if loop.index0 > ns.last_query_index %}",
    "{%- if loop.index0 > ns.last_query_index or preserve_thinking %}",
)
assert QWEN3_PRESERVING != QWEN3
# A template whose reply begins inside <think> (as DeepSeek-R1's distills'), with no switch.
OPENING = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING = "Let me think.\nTwo lines of it."
ANSWER = "The answer."
THOUGHT = f"<think>\n{REASONING}\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MODEL = "fake"


def _template(source: str) -> ChatTemplate:
    return ChatTemplate.from_source(source, bos_token="", eos_token="")


def test_a_template_says_what_it_does_with_reasoning() -> None:
    assert _template(QWEN3).thinking == ThinkingSupport(switch=True, opens=False, preserve=False)
    assert _template(QWEN3_PRESERVING).thinking == ThinkingSupport(True, False, True)
    assert _template(OPENING).thinking == ThinkingSupport(switch=False, opens=True, preserve=False)
    assert _template(CHATML).thinking is None
    qwen25 = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()
    assert _template(qwen25).thinking is None


def _prompt(request: GenerationRequest) -> str:
    """The fake tokenizer's text of a request's prompt (one character a token)."""
    return "".join(chr(t - 1) for t in request.prompt_ids)


def _writes(request: GenerationRequest) -> str:
    """What the fake model answers: reasoning first, unless the prompt closed the block;
    a call when the prompt offers tools."""
    prompt = _prompt(request)
    answer = CALL if "<tools>" in prompt else ANSWER
    if prompt.endswith("</think>\n\n"):  # thinking off: the template closed the block
        return answer
    if prompt.endswith("<think>\n"):  # the prompt opened it
        return f"{REASONING}\n</think>\n\n{answer}"
    return THOUGHT + answer


@asynccontextmanager
async def _serving(
    tmp_path: Path, template: str = QWEN3, **settings: Any
) -> AsyncIterator[tuple[Server, FakeEngine]]:
    engine = FakeEngine(step_s=0.0005, script=_writes, template=template, max_context=2048)
    async with serve(Path("fake"), tmp_path, engine=engine, served_model_name=[MODEL],
                     max_concurrency=4, **settings) as srv:  # fmt: skip
        yield srv, engine


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Why?"}], **fields}


def _sse(body: bytes) -> list[Any]:
    out = []
    for block in body.decode().strip().split("\n\n"):
        data = next(line[6:] for line in block.splitlines() if line.startswith("data: "))
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def _starts(srv: Server) -> list[dict[str, Any]]:
    return [r for r in srv.log_records() if r["event"] == "request_start"]


async def test_chat_answers_the_reasoning_apart(tmp_path: Path) -> None:
    async with _serving(tmp_path) as (srv, engine), srv.client() as c:
        whole = (await c.post("/v1/chat/completions", json=_chat())).json()
        streamed = await c.post("/v1/chat/completions", json=_chat(
            stream=True, stream_options={"include_usage": True}))  # fmt: skip
        starts = _starts(srv)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, ANSWER)
    assert whole["choices"][0]["finish_reason"] == "stop"
    # every token up to and including the one that closes the block is reasoning
    reasoning_tokens = len(THOUGHT.rstrip("\n"))
    usage = whole["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert usage["completion_tokens"] == len(THOUGHT + ANSWER)
    chunks = _sse(streamed.content)
    assert chunks[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    assert not any("reasoning_content" in d and "content" in d for d in deltas)
    assert chunks[-2]["usage"] == usage  # the stream counts as the body does
    assert [s["thinking"] for s in starts] == [
        {"enabled": True, "preserve": False, "source": "server"}] * 2  # fmt: skip
    assert not _prompt(engine.submitted[0]).endswith("</think>\n\n")


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none"},
    ],
)
async def test_a_chat_request_turns_thinking_off(tmp_path: Path, fields: dict[str, Any]) -> None:
    async with _serving(tmp_path) as (srv, engine), srv.client() as c:
        r = await c.post("/v1/chat/completions", json=_chat(**fields))
        (start,) = _starts(srv)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == ANSWER
    assert "reasoning_content" not in message
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # Qwen 3's template closes an empty block itself when thinking is off
    assert _prompt(engine.submitted[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert start["thinking"] == {"enabled": False, "preserve": False, "source": "request"}


async def test_no_thinking_is_the_servers_default_and_a_request_may_still_ask(
    tmp_path: Path,
) -> None:
    async with _serving(tmp_path, no_thinking=True) as (srv, _engine), srv.client() as c:
        off = (await c.post("/v1/chat/completions", json=_chat())).json()
        on = (await c.post("/v1/chat/completions", json=_chat(reasoning_effort="low"))).json()
        props = (await c.get("/props")).json()
    assert "reasoning_content" not in off["choices"][0]["message"]
    assert on["choices"][0]["message"]["reasoning_content"] == REASONING
    assert props["capabilities"]["thinking"] is True
    assert props["thinking"] == {"supported": True, "default": False, "preserve": False,
                                 "preserve_supported": False, "opens_block": False}  # fmt: skip


async def test_a_prompt_that_opens_the_block_is_read_from_its_start(tmp_path: Path) -> None:
    """A template whose reply begins inside <think>: the output is reasoning up to
    </think>; turned off, the block is closed in the prompt."""
    async with _serving(tmp_path, template=OPENING) as (srv, engine), srv.client() as c:
        on = (await c.post("/v1/chat/completions", json=_chat())).json()
        off = (await c.post("/v1/chat/completions", json=_chat(reasoning_effort="none"))).json()
    assert on["choices"][0]["message"]["reasoning_content"] == REASONING
    assert on["choices"][0]["message"]["content"] == ANSWER
    assert off["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                            "refusal": None}  # fmt: skip
    assert _prompt(engine.submitted[1]).endswith("<|assistant|><think>\n\n</think>\n\n")


async def test_anthropic_thinking_blocks(tmp_path: Path) -> None:
    body = {"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "Why?"}]}
    async with _serving(tmp_path) as (srv, _engine), srv.client() as c:
        whole = (await c.post("/v1/messages", json=body)).json()
        streamed = await c.post("/v1/messages", json={**body, "stream": True})
        off = (await c.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}})).json()
        on = await c.post("/v1/messages", json={
            **body, "thinking": {"type": "enabled", "budget_tokens": 1024}})  # fmt: skip
    signature = hashlib.sha256(REASONING.encode()).hexdigest()
    assert whole["content"] == [
        {"type": "thinking", "thinking": REASONING, "signature": signature},
        {"type": "text", "text": ANSWER},
    ]
    assert on.json()["content"] == whole["content"]
    assert off["content"] == [{"type": "text", "text": ANSWER}]
    events = _sse(streamed.content)
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type"))
             for e in events]  # fmt: skip
    thinking_deltas = [e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta"]  # fmt: skip
    assert "".join(thinking_deltas) == REASONING
    first_stop = kinds.index(("content_block_stop", None))
    assert kinds[first_stop - 1] == ("content_block_delta", "signature_delta")
    assert events[first_stop - 1]["delta"]["signature"] == signature
    assert kinds.count(("content_block_start", "thinking")) == 1
    assert kinds.count(("content_block_start", "text")) == 1
    text = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "text_delta"]  # fmt: skip
    assert "".join(text) == ANSWER


async def test_responses_reasoning_items_and_their_continuation(tmp_path: Path) -> None:
    """The reasoning is an output Item (and streamed as reasoning_text events); a
    continuation replays it into the history, where a template that preserves it keeps
    it in the prompt."""
    async with (
        _serving(tmp_path, template=QWEN3_PRESERVING, preserve_thinking=True) as (srv, engine),
        srv.client() as c,
    ):
        first = (await c.post("/v1/responses", json={"model": MODEL, "input": "Why?"})).json()
        streamed = await c.post("/v1/responses", json={"model": MODEL, "input": "Why?",
                                                       "stream": True})  # fmt: skip
        second = await c.post("/v1/responses", json={
            "model": MODEL, "input": "And then?", "previous_response_id": first["id"]})  # fmt: skip
        off = (await c.post("/v1/responses", json={
            "model": MODEL, "input": "Why?", "reasoning": {"effort": "none"}})).json()  # fmt: skip
        replayed = await c.post("/v1/responses", json={"model": MODEL, "input": [
            {"role": "user", "content": "Why?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Replayed thought."}]},
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "And then?"}]})  # fmt: skip
    reasoning, message = first["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert reasoning["summary"] == []
    assert message["content"][0]["text"] == ANSWER
    assert first["usage"]["output_tokens_details"] == {"reasoning_tokens": len(THOUGHT) - 2}
    events = _sse(streamed.content)
    types = [e["type"] for e in events]
    delta = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(delta) == REASONING
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == REASONING
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert events[-1]["response"]["output"][0]["content"] == reasoning["content"]
    assert events[-1]["response"]["usage"] == {**first["usage"],
                                               "input_tokens": events[-1]["response"]["usage"][
                                                   "input_tokens"]}  # fmt: skip
    assert second.status_code == 200, second.text
    assert f"<think>\n{REASONING}\n</think>" in _prompt(engine.submitted[2])
    assert [i["type"] for i in off["output"]] == ["message"]
    assert replayed.status_code == 200, replayed.text
    assert "<think>\nReplayed thought.\n</think>" in _prompt(engine.submitted[4])


async def test_tools_after_thinking(tmp_path: Path) -> None:
    """The call follows the reasoning; the grammar it was decoded under begins with a
    free reasoning block."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    async with _serving(tmp_path) as (srv, engine), srv.client() as c:
        r = await c.post("/v1/chat/completions", json=_chat(tools=[tool]))
        streamed = await c.post("/v1/chat/completions", json=_chat(tools=[tool], stream=True))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == REASONING
    (call,) = choice["message"]["tool_calls"]
    assert orjson.loads(call["function"]["arguments"]) == {"city": "Paris"}
    grammar = engine.submitted[0].sampling.grammar
    assert isinstance(grammar, str)
    assert grammar.splitlines()[1] == 'start: "<think>"? THINK BLANK? answer'
    deltas = [c["choices"][0]["delta"] for c in _sse(streamed.content)[:-1] if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert any(d.get("tool_calls") for d in deltas)


async def test_what_a_template_cannot_do_is_refused_by_name(tmp_path: Path) -> None:
    async with _serving(tmp_path, template=CHATML) as (srv, _engine), srv.client() as c:
        asked = [
            ("/v1/chat/completions", _chat(reasoning_effort="high"), "reasoning_effort"),
            ("/v1/chat/completions", _chat(chat_template_kwargs={"enable_thinking": True}),
             "chat_template_kwargs.enable_thinking"),
            ("/v1/messages", {"model": MODEL, "max_tokens": 2000, "thinking": {
                "type": "enabled", "budget_tokens": 1024}, "messages": [
                {"role": "user", "content": "Why?"}]}, "thinking"),
            ("/v1/responses", {"model": MODEL, "input": "Why?", "reasoning": {"effort": "low"}},
             "reasoning.effort"),
        ]  # fmt: skip
        for path, body, param in asked:
            r = await c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert "has no thinking support" in error["message"]
            if path != "/v1/messages":  # Anthropic's envelope has no param
                assert error["param"] == param
        allowed = await c.post("/v1/chat/completions", json=_chat(reasoning_effort="none"))
        assert allowed.status_code == 200
        assert "reasoning_content" not in allowed.json()["choices"][0]["message"]
    (tmp_path / "q").mkdir()
    async with _serving(tmp_path / "q", template=QWEN3) as (srv, _engine), srv.client() as c:
        r = await c.post("/v1/chat/completions",
                         json=_chat(chat_template_kwargs={"preserve_thinking": True}))  # fmt: skip
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "chat_template_kwargs.preserve_thinking"
        for fields, param in (
            ({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"},
             "chat_template_kwargs.enable_thinking"),
            ({"chat_template_kwargs": {"temperature": 1}}, "chat_template_kwargs.temperature"),
            ({"chat_template_kwargs": {"enable_thinking": "yes"}},
             "chat_template_kwargs.enable_thinking"),
            ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ):  # fmt: skip
            r = await c.post("/v1/chat/completions", json=_chat(**fields))
            assert r.status_code == 400, fields
            assert r.json()["error"]["param"] == param
        for thinking, param in (
            ({"type": "enabled"}, "thinking.budget_tokens"),
            ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),
            ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # >= max
            ({"type": "disabled", "budget_tokens": 2048}, "thinking.budget_tokens"),
        ):
            r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 2048,
                             "thinking": thinking, "messages": [
                                 {"role": "user", "content": "Why?"}]})  # fmt: skip
            assert r.status_code == 400, thinking
            assert param.split(".")[1] in r.json()["error"]["message"]


# ---- the SDKs ------------------------------------------------------------------------------


async def test_the_openai_and_anthropic_sdks_read_the_reasoning(tmp_path: Path) -> None:

    async with _serving(tmp_path) as (srv, _engine):
        with trio.fail_after(SERVER_HANG_GUARD_S):
            oa = srv.openai("x")
            chat = await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Why?"}])  # fmt: skip
            message: Any = chat.choices[0].message
            assert message.content == ANSWER
            assert message.model_extra["reasoning_content"] == REASONING
            assert chat.usage is not None
            assert chat.usage.completion_tokens_details is not None
            assert chat.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT) - 2
            response = await oa.responses.create(model=MODEL, input="Why?")
            assert response.output_text == ANSWER
            assert response.output[0].type == "reasoning"
            assert response.output[0].content is not None
            assert response.output[0].content[0].text == REASONING
            an = srv.anthropic("x")
            msg = await an.messages.create(
                model=MODEL, max_tokens=2048, messages=[{"role": "user", "content": "Why?"}],
                thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
            assert [b.type for b in msg.content] == ["thinking", "text"]
            assert msg.content[0].thinking == REASONING  # type: ignore[union-attr]
            async with an.messages.stream(
                model=MODEL, max_tokens=2048, messages=[{"role": "user", "content": "Why?"}],
            ) as stream:  # fmt: skip
                final = await stream.get_final_message()
            assert final.content[0].type == "thinking"
            assert final.content[0].thinking == REASONING
            assert final.content[0].signature == hashlib.sha256(REASONING.encode()).hexdigest()
            # The conversation goes on with the thinking block replayed.
            follow = await an.messages.create(model=MODEL, max_tokens=2048, messages=[
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": final.content},
                {"role": "user", "content": "And then?"}])  # type: ignore[list-item]  # fmt: skip
            assert follow.content[-1].text == ANSWER  # type: ignore[union-attr]


def _agents_two_turns(url: str) -> list[str]:
    """openai-agents over the Responses route: two turns, the second given the first's
    items (reasoning Items among them) as its input."""
    import asyncio

    import agents
    import openai

    agents.set_tracing_disabled(True)

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = agents.Agent(name="a", instructions="Answer.", model=model)
        first = await agents.Runner.run(agent, "Why?")
        items = first.to_input_list()
        second = await agents.Runner.run(agent, [*items, {"role": "user", "content": "And?"}])
        kinds = [i.type for i in first.new_items]
        return [str(first.final_output), str(second.final_output), *kinds]

    return asyncio.run(main())


async def test_openai_agents_carries_reasoning_items_between_turns(tmp_path: Path) -> None:
    pytest.importorskip("agents")
    async with _serving(tmp_path) as (srv, engine):
        with trio.fail_after(SERVER_HANG_GUARD_S):
            first, second, *kinds = await trio.to_thread.run_sync(_agents_two_turns, srv.url)
    assert (first, second) == (ANSWER, ANSWER)
    assert kinds == ["reasoning_item", "message_output_item"]
    # the second turn's prompt holds the first answer (its reasoning dropped by Qwen 3's
    # template, which keeps only the reasoning after the last user turn)
    assert ANSWER in _prompt(engine.submitted[1])


# ---- the grammar and the real engine -------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", architecture="qwen3")


def _accepts(grammar: str, text: str, qwen3_gguf: Path) -> bool:
    """Whether the grammar lets the model write `text` whole (and then end)."""
    import torch

    model = load_model(str(qwen3_gguf), dtype=torch.float32, device="cpu", max_positions=512)
    tok = model.tokenizer
    ll = grammar_tokenizer(GrammarVocabulary.of(tok), tok.vocab_size)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    ids = tok.encode(text)
    if tok.add_bos and ids and ids[0] == tok.bos_id:
        ids = ids[1:]
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return bool(matcher.is_accepting())


def test_the_grammar_starts_after_the_reasoning(qwen3_gguf: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    thinking = json_schema_grammar(schema, param="x", think=True)
    assert _accepts(thinking, '<think>\nI think.\n</think>\n\n{"a":1}', qwen3_gguf)
    assert _accepts(thinking, 'opened by the prompt</think>{"a":2}', qwen3_gguf)
    assert not _accepts(thinking, '{"a":1}', qwen3_gguf)  # the reasoning must close first
    assert not _accepts(thinking, "<think>\nno answer after it\n</think>\n\n", qwen3_gguf)
    assert not _accepts(thinking, '<think>\nx</think>{"a":1}</think>', qwen3_gguf)
    plain = json_schema_grammar(schema, param="x")
    assert _accepts(plain, '{"a":1}', qwen3_gguf)
    tool = Tool("f", None, {"type": "object", "properties": {"c": {"type": "string"}}}, "p")
    tools = tool_grammar(ToolPlan.of((tool,), "required", False), None, "t", think=True)
    call = '<tool_call>\n{"name": "f", "arguments": {"c": "x"}}\n</tool_call>'
    assert _accepts(tools, f"<think>\nwhich tool?\n</think>\n\n{call}", qwen3_gguf)
    assert not _accepts(tools, call, qwen3_gguf)


def test_the_reader_splits_any_way_the_text_is_cut() -> None:
    text = THOUGHT + ANSWER
    for size in (1, 2, 3, 5, 8, len(text)):
        reader = OutputReader.of(True, False, False)
        pieces = []
        for i in range(0, len(text), size):
            pieces += reader.feed(text[i : i + size], 1)
        pieces += reader.finish()
        assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) == REASONING
        assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == ANSWER
    reader = OutputReader.of(True, False, False)
    assert reader.feed("No reasoning at all.", 1) + reader.finish() == [
        TextPiece("No reasoning at all.")]  # fmt: skip
    assert reader.reasoning_tokens == 0
    cut = OutputReader.of(True, False, False)  # the budget ended it inside the reasoning
    assert cut.feed("<think>\nhalf a thou", 1) + cut.finish() == [
        ReasoningPiece("half a thou")]  # fmt: skip


async def test_the_tiny_qwen3_model_thinks_and_is_logged(qwen3_gguf: Path, tmp_path: Path) -> None:
    """The real engine under Qwen 3's template (given by --chat-template): thinking on by
    default, off by request; the prompt grows by the closed empty block; answers stay
    well formed whatever the random model writes."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    async with serve(qwen3_gguf, tmp_path, chat_template=str(template),
                     served_model_name=[MODEL]) as srv, srv.client() as c:  # fmt: skip
        on = await c.post("/v1/chat/completions", json=_chat(max_tokens=8, temperature=0))
        off = await c.post(
            "/v1/chat/completions", json=_chat(max_tokens=8, temperature=0, reasoning_effort="none")
        )
        structured = await c.post("/v1/chat/completions", json=_chat(
            max_tokens=8, response_format={"type": "json_object"}))  # fmt: skip
        counted = await c.post("/v1/messages/count_tokens", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Why?"}],
            "thinking": {"type": "disabled"}})  # fmt: skip
        records = srv.log_records()
    for r in (on, off, structured):
        assert r.status_code == 200, r.text
    usage_on, usage_off = on.json()["usage"], off.json()["usage"]
    assert usage_off["prompt_tokens"] > usage_on["prompt_tokens"]  # <think>\n\n</think>\n\n
    assert counted.json()["input_tokens"] == usage_off["prompt_tokens"]
    assert usage_off["completion_tokens_details"]["reasoning_tokens"] == 0
    starts = [r["thinking"] for r in records if r["event"] == "request_start"]
    assert [s["enabled"] for s in starts] == [True, False, True]


async def test_count_tokens_and_the_flag_agree(tmp_path: Path) -> None:
    """--no-thinking changes the prompt the way a request's switch does."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Why?"}]}
    async with _serving(tmp_path, no_thinking=True) as (srv, _engine), srv.client() as c:
        default = (await c.post("/v1/messages/count_tokens", json=body)).json()
        on = (await c.post("/v1/messages/count_tokens", json={
            **body, "thinking": {"type": "adaptive"}})).json()  # fmt: skip
    assert default["input_tokens"] == on["input_tokens"] + len("<think>\n\n</think>\n\n")
