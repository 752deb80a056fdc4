"""Tool calls on every protocol, guaranteed by constrained decoding: on the tiny
random-weight model (a model that knows nothing), every call a request is answered with
parses and matches its tool's schema, through the official SDKs (openai chat and
Responses, anthropic) and pydantic-ai; the generic prompt for templates without tools
and the Hermes markup of templates with them; the refusals; the stream reader."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import trio
from conftest import QWEN25
from contract import check_answer
from server import serve, serve_model

from ninfer.engine._tokenizer import ChatTemplate
from ninfer.frontends._output import Reading
from ninfer.frontends._tools import (
    CallArgs,
    CallStart,
    TextPiece,
    Tool,
    ToolCallTurn,
    ToolStream,
    generic_section,
    render_tool_turns,
)

# Bounded: a random model's call must end within the budget, whatever its weights.
PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in CHAT_TOOLS}
HANG_GUARD_S = 300  # a machine five times slower than this one
# Greedy: what these tests assert holds for any weights; greedy makes each run the same.
GREEDY = {"temperature": 0}


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- the stream reader ----------------------------------------------------------------


def _call(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.mark.parametrize(
    "text",
    [
        "Just text, with a <tool_ prefix and a brace }",
        _call("f", {"a": 'x}{"\\', "b": [1, {"c": [2]}]}),
        "I will look.\n\n" + _call("f", {"x": 1}) + "\n" + _call("g", {}) + "\n",
        _call("f", {"a": 1})[:-22],  # cut inside its arguments
        '<tool_call>\n{"na',  # cut inside its head
    ],
)
def test_stream_reader_reads_any_split_as_the_whole(text: str) -> None:
    """Fed in pieces of any size, the reader gives the text and calls that reading the
    whole gives: text without the blanks before a call, each call's arguments exactly as
    generated, and a call cut short is reported, not given."""
    whole = Reading(tools=True).read(text, ())  # the whole output, as answers read it
    rng = random.Random(0)
    for _ in range(50):
        reader, events, at = ToolStream(), [], 0
        while at < len(text):
            size = rng.randint(1, 7)
            events += reader.feed(text[at : at + size])
            at += size
        events += reader.finish()
        assert "".join(e.text for e in events if isinstance(e, TextPiece)) == whole.text
        args: dict[int, str] = {}
        for e in events:
            if isinstance(e, CallArgs):
                args[e.index] = args.get(e.index, "") + e.text
        names = [e.name for e in events if isinstance(e, CallStart)]
        done = [(c.name, c.arguments) for c in whole.calls]
        assert (
            list(zip(names, [args.get(i, "") for i in range(len(names))], strict=True))[: len(done)]
            == done
        )
    if "</tool_call>" in text:
        assert not whole.truncated
        assert all(json.loads(c.arguments) is not None for c in whole.calls)
    elif "<tool_call>" in text:
        assert whole.truncated
        assert not whole.calls


# ---- the prompt -------------------------------------------------------------------------


TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [ToolCallTurn("call_1", "get_weather", {"city": "Paris"})]},
    {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]  # fmt: skip
TOOL = Tool("get_weather", "The forecast", PARAMS, "tools[0]")


def test_generic_section_and_history_for_a_template_without_tools() -> None:
    """The tools are described in a system section (after the request's own system
    text), calls are replayed in the markup the model is asked to write, and results
    are one user turn of <tool_response> blocks."""
    system = [{"role": "system", "content": "Be brief."}, *TURNS]
    messages, offered = render_tool_turns(system, [TOOL], native=False)
    assert offered is None
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOL.spec()) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": _call("get_weather", {"city": "Paris"})}
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response>",
    }
    assert len(messages) == 4


def test_docs_show_the_generic_section_as_written() -> None:
    """docs/api.md quotes the generic section for one tool: the quote is the code's."""
    docs = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    quoted = docs.split("The section, for one tool", 1)[1].split("```\n", 2)[1]
    weather = Tool("get_weather", "The current weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}, "tools[0]")  # fmt: skip
    assert quoted == generic_section([weather]) + "\n"


def test_a_hermes_template_renders_tools_and_calls_itself() -> None:
    """Qwen 2.5's template is given the tools and transformers' message shapes: its own
    system section lists the tool, its calls and results are in the same markup the
    grammar makes the model write."""
    template = ChatTemplate.from_source(QWEN25, bos_token="", eos_token="")
    assert template.writes_tool_calls
    messages, offered = render_tool_turns(TURNS, [TOOL], native=True)
    text = template.render(messages, tools=offered)
    assert json.dumps(TOOL.spec(), ensure_ascii=False) in text
    assert _call("get_weather", {"city": "Paris"}) in text
    assert (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in text
    )


# ---- the guarantee, through the SDKs, on a random model ---------------------------------


async def test_openai_chat_calls_of_a_random_model_parse_and_match(
    roomy_gguf: Path, tmp_path: Path
) -> None:
    """`required` (one call, and parallel calls), a named function and `auto`, sampled at
    temperature 1 with several seeds: every call parses and matches its function's
    schema; an answer of one call ends by itself with finish_reason tool_calls (parallel
    calls end when the model ends them, or at the budget: which, depends on the weights);
    streamed deltas (id and name first, then arguments) join into the same calls as the
    whole answer of the same seed."""
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv, srv.client() as http:
            client = srv.openai()
            name = (await client.models.list()).data[0].id
            msgs: Any = [{"role": "user", "content": "weather?"}]
            named = {"type": "function", "function": {"name": "get_time"}}
            cases = [("required", False), (named, True), ("required", True), ("auto", False)]
            for seed, (choice, parallel) in enumerate(cases):
                r = await client.chat.completions.create(
                    model=name, messages=msgs, tools=CHAT_TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                    max_tokens=400, temperature=1.0, seed=seed, parallel_tool_calls=parallel,
                )  # fmt: skip
                c = r.choices[0]
                if choice == "auto" and not c.message.tool_calls:
                    assert "<tool_call>" not in (c.message.content or "")
                    continue
                ended = (
                    ("tool_calls", "length") if parallel and choice != named else ("tool_calls",)
                )
                assert c.finish_reason in ended, c.message
                assert c.message.tool_calls
                if not parallel or choice == named:
                    assert len(c.message.tool_calls) == 1
                for call in c.message.tool_calls:
                    assert call.type == "function"
                    assert call.id.startswith("call_")
                    _check_call(call.function.name, call.function.arguments)
                if choice == named:
                    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
                body = {"model": name, "messages": msgs, "tools": CHAT_TOOLS, "seed": seed,
                        "tool_choice": choice, "max_tokens": 400, "temperature": 1.0,
                        "parallel_tool_calls": parallel}  # fmt: skip
                plain = await http.post("/v1/chat/completions", json=body)
                check_answer("/v1/chat/completions", plain, body)
                streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
                check_answer("/v1/chat/completions", streamed, body)
                calls: dict[int, dict[str, str]] = {}
                for line in streamed.text.splitlines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for d in (
                            (chunk["choices"] or [{}])[0].get("delta", {}).get("tool_calls", [])
                        ):
                            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                            call["name"] += d.get("function", {}).get("name") or ""
                            call["arguments"] += d.get("function", {}).get("arguments") or ""
                        finish = (chunk["choices"] or [{}])[0].get("finish_reason")
                whole = plain.json()["choices"][0]["message"]["tool_calls"]
                assert [calls[i] for i in sorted(calls)] == [
                    {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                    for t in whole
                ]
                assert finish == c.finish_reason


async def test_anthropic_tool_use_of_a_random_model(roomy_gguf: Path, tmp_path: Path) -> None:
    """anthropic's client, tool_choice any and a named tool, one call each, whole and
    streamed (input_json_delta), greedy: stop_reason tool_use, the input matches its
    schema; a tool_result (an error one) in the history is taken. The first tool has
    every field of the SDK's ToolParam (as the Vercel AI SDK sends them)."""
    tools: Any = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in CHAT_TOOLS]  # fmt: skip
    tools[0].update(type="custom", strict=True, eager_input_streaming=True,
                    input_examples=[{"city": "Paris"}], cache_control={"type": "ephemeral"},
                    allowed_callers=["direct"], defer_loading=False)  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv:
            client = srv.anthropic("x")
            name = (await srv.openai().models.list()).data[0].id
            msgs: Any = [{"role": "user", "content": "weather?"}]
            r = await client.messages.create(
                model=name, max_tokens=400, messages=msgs, tools=tools, extra_body=GREEDY,
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
            )  # fmt: skip
            assert r.stop_reason == "tool_use"
            uses = [b for b in r.content if b.type == "tool_use"]
            assert uses
            assert all(u.id.startswith("toolu_") for u in uses)
            for u in uses:
                jsonschema.validate(u.input, SCHEMAS[u.name])
            async with client.messages.stream(
                model=name, max_tokens=400, messages=msgs, tools=tools,
                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
            ) as stream:  # fmt: skip
                final = await stream.get_final_message()
            assert final.stop_reason == "tool_use"
            assert [b.type for b in final.content] == ["tool_use"]
            use = final.content[0]
            assert use.type == "tool_use"
            assert use.name == "get_weather"
            jsonschema.validate(use.input, PARAMS)
            history: Any = [*msgs, {"role": "assistant", "content": [use.model_dump()]},
                            {"role": "user", "content": [
                                {"type": "tool_result", "tool_use_id": use.id,
                                 "content": "no such city", "is_error": True}]}]  # fmt: skip
            after = await client.messages.create(model=name, max_tokens=5, messages=history,
                                                 tools=tools, extra_body=GREEDY)  # fmt: skip
            assert after.type == "message"

            # the replayed call and its result are in the prompt: longer than the question
            def prompt(u: Any) -> int:  # Anthropic's input_tokens leave out cache reads
                return int(u.input_tokens + (u.cache_read_input_tokens or 0))

            assert prompt(after.usage) > prompt(r.usage)


async def test_responses_function_calls_of_a_random_model(roomy_gguf: Path, tmp_path: Path) -> None:
    """responses.create with function tools: function_call Items (fc_ ids, distinct
    call_ ids) whose arguments match; streamed as function_call_arguments delta and done
    events; a function_call_output continues the stored Response."""
    tools: Any = [{"type": "function", "name": t["function"]["name"],
                   "parameters": t["function"]["parameters"], "strict": True}
                  for t in CHAT_TOOLS]  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv:
            client = srv.openai()
            name = (await client.models.list()).data[0].id
            r = await client.responses.create(
                model=name, input="weather?", tools=tools, tool_choice="required",
                max_output_tokens=400, temperature=0, parallel_tool_calls=False,
            )  # fmt: skip
            assert r.status == "completed"
            calls = [i for i in r.output if i.type == "function_call"]
            assert calls
            for call in calls:
                assert call.id
                assert call.id.startswith("fc_")
                assert call.call_id.startswith("call_")
                _check_call(call.name, call.arguments)
            assert len({c.call_id for c in calls}) == len(calls)
            outputs: Any = [{"type": "function_call_output", "call_id": c.call_id, "output": "18C"}
                            for c in calls]  # fmt: skip
            after = await client.responses.create(
                model=name, previous_response_id=r.id, input=outputs, tools=tools,
                max_output_tokens=16,
            )  # fmt: skip
            # the continuation replays the calls and their outputs after the first prompt
            assert after.usage is not None
            assert r.usage is not None
            assert after.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
            kinds: list[str] = []
            stream = await client.responses.create(
                model=name, input="weather?", tools=tools, max_output_tokens=400,
                tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                temperature=0,
            )  # fmt: skip
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.function_call_arguments.done":
                    jsonschema.validate(json.loads(event.arguments), PARAMS)
                if event.type == "response.completed":
                    done = event.response.output
            assert "response.function_call_arguments.delta" in kinds
            assert [i.type for i in done] == ["function_call"]


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    unit: Literal["c", "f"]
    days: int = pydantic.Field(ge=1, le=9)


async def test_pydantic_ai_output_type_on_a_random_model(roomy_gguf: Path, tmp_path: Path) -> None:
    """pydantic-ai's structured output (its final_result tool, tool choice required):
    the random model's answer validates into the output type at the first try."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    with trio.fail_after(HANG_GUARD_S):
        async with serve(roomy_gguf, tmp_path) as srv:
            name = (
                (
                    await openai.AsyncOpenAI(
                        base_url=srv.url + "/v1", api_key="x", max_retries=0
                    ).models.list()
                )
                .data[0]
                .id
            )
            model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=srv.url + "/v1",
                                                                  api_key="x"))  # fmt: skip
            agent = Agent(model, output_type=Forecast, retries=0,
                          model_settings={"max_tokens": 300, "temperature": 0,
                                          "parallel_tool_calls": False})  # fmt: skip
            # pydantic-ai runs on asyncio: on a thread of its own, as a client would
            result = await trio.to_thread.run_sync(agent.run_sync, "the forecast")
            assert isinstance(result.output, Forecast)


# ---- refusals ----------------------------------------------------------------------------


REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
     "tools[0].custom"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": CHAT_TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": CHAT_TOOLS * 2}, "tools[2].function.name"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ("/v1/messages", {"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": PARAMS}],
                      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": PARAMS, "defer_loading": True}]},
     "tools[0].defer_loading"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": PARAMS,
                                 "allowed_callers": ["code_execution_20250825"]}]},
     "tools[0].allowed_callers"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "tool", "content": "18C", "tool_call_id": "call_never_made"}]},
     "messages[1].tool_call_id"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c9",
                                  "output": "x"}]}, "input[0].call_id"),
    ("/v1/chat/completions", {"tools": CHAT_TOOLS * 65}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 2049},
     "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": "x"}] * 2049}, "input"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                  "output": "x", "role": "user"}]}, "input[0].role"),
]  # fmt: skip


async def test_malformed_tools_and_histories_are_refused_by_name(
    roomy_gguf: Path, tmp_path: Path
) -> None:
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            base: dict[str, dict[str, Any]] = {
                "/v1/chat/completions": {"model": name, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "x"}]},
                "/v1/messages": {"model": name, "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "x"}]},
                "/v1/responses": {"model": name, "max_output_tokens": 16, "input": "x"},
            }  # fmt: skip
            for path, fields, param in REFUSALS:
                r = await http.post(path, json={**base[path], **fields})
                assert r.status_code == 400, (path, fields, r.text)
                error = r.json()["error"]
                if path == "/v1/messages":
                    assert param in error["message"] or error.get("param") == param, r.text
                else:
                    assert error["param"] == param, (param, r.text)
                assert "not json" not in r.text


@pytest.mark.realmodel
async def test_smollm2_calls_the_named_tool(real_gguf: Path, tmp_path: Path) -> None:
    """The default model (no tool section in its template: the generic one), greedy,
    one call: get_weather for Paris, in celsius."""
    with trio.fail_after(HANG_GUARD_S):
        async with serve(real_gguf, tmp_path) as srv:
            client = srv.openai()
            name = (await client.models.list()).data[0].id
            r = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
                max_tokens=100, temperature=0,
            )  # fmt: skip
            c = r.choices[0]
            assert c.finish_reason == "tool_calls"
            assert c.message.tool_calls is not None
            assert len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] == "Paris"


async def test_a_call_cut_by_the_budget_is_reported_not_given(
    roomy_gguf: Path, tmp_path: Path
) -> None:
    """A budget too small for the call: a whole chat answer has no tool_calls (their
    arguments would not parse) and says `length`; a streamed Response ends incomplete
    with the call's Item incomplete, and continuing from it still works (the cut call
    is not replayed)."""
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv:
            client = srv.openai()
            name = (await client.models.list()).data[0].id
            r = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x"}], tools=CHAT_TOOLS,
                tool_choice="required", max_tokens=12, temperature=0,
            )  # fmt: skip
            assert r.choices[0].finish_reason == "length"
            assert not r.choices[0].message.tool_calls
            stream = await client.responses.create(
                model=name, input="x", tools=tools, tool_choice="required",
                max_output_tokens=64, stream=True,  # past the call's name, not its end
                temperature=0,
            )  # fmt: skip
            async for event in stream:
                if event.type == "response.incomplete":
                    cut = event.response
            assert [(i.type, i.status) for i in cut.output] == [("function_call", "incomplete")]
            after = await client.responses.create(
                model=name, previous_response_id=cut.id, input="go on", max_output_tokens=16
            )
            assert after.status in ("completed", "incomplete")


async def test_the_request_log_says_tools_without_their_schemas(
    roomy_gguf: Path, tmp_path: Path
) -> None:
    """request_start counts the tools and names the choice, and gives a constrained
    request's grammar by its size: the schemas and descriptions are the client's text,
    never written (nor the grammar built from them)."""
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv:
            client = srv.openai()
            name = (await client.models.list()).data[0].id
            await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x"}], tools=CHAT_TOOLS,
                tool_choice="required", max_tokens=8, temperature=0,
            )  # fmt: skip
            log = srv.log_path
    starts = [json.loads(line) for line in log.read_text().splitlines()
              if '"request_start"' in line]  # fmt: skip
    assert starts[-1]["tools"] == 2
    assert starts[-1]["tool_choice"] == "required"
    assert starts[-1]["sampling"]["grammar_bytes"] > 100
    assert "grammar" not in starts[-1]["sampling"]
    assert "The forecast" not in log.read_text()
    assert "maxLength" not in log.read_text()


def _agents_tool_run(url: str) -> tuple[list[str], str]:
    """openai-agents (asyncio, on its own loop in a worker thread) with a function tool
    it must call first, through its Responses model: the calls the tool received and
    the final output."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)  # no trace upload: nothing outside this machine
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return "18 degrees and sunny"

    async def main() -> str:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="assistant",
            model=agents.OpenAIResponsesModel(model="smollm2", openai_client=client),
            tools=[get_weather],
            # The tool's result is the answer: SmolLM2, never trained for tools, rambles
            # past any budget when asked to answer from a result.
            tool_use_behavior="stop_on_first_tool",
            model_settings=agents.ModelSettings(
                max_tokens=96, temperature=0.0, tool_choice="required", parallel_tool_calls=False
            ),
        )
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        return str(result.final_output)

    return seen, asyncio.run(main())


@pytest.mark.realmodel
async def test_openai_agents_calls_a_function_tool(real_gguf: Path, tmp_path: Path) -> None:
    """openai-agents runs its tools on /v1/responses: the model's function_call Item
    reaches the Python function with its argument (Paris), whose result ends the run."""
    with trio.fail_after(HANG_GUARD_S):
        async with serve(real_gguf, tmp_path, served_model_name=["smollm2"]) as srv:
            seen, final = await trio.to_thread.run_sync(_agents_tool_run, srv.url)
    assert seen == ["Paris"]
    assert final == "18 degrees and sunny"


async def test_tool_answers_match_the_published_contract(roomy_gguf: Path, tmp_path: Path) -> None:
    """Whole and streamed answers with calls, on each route, validate strictly against
    docs/openapi.json's shapes (no field beyond them)."""
    anthropic_tools = [{"name": "get_weather", "input_schema": PARAMS}]
    with trio.fail_after(HANG_GUARD_S):
        async with serve_model(roomy_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            bodies: list[tuple[str, dict[str, Any]]] = [
                ("/v1/chat/completions", {"model": name, "max_tokens": 300, "temperature": 0,
                                          "messages": [{"role": "user", "content": "x"}],
                                          "tools": CHAT_TOOLS, "tool_choice": "required"}),
                ("/v1/messages", {"model": name, "max_tokens": 300, "temperature": 0,
                                  "messages": [{"role": "user", "content": "x"}],
                                  "tools": anthropic_tools, "tool_choice": {"type": "any"}}),
                ("/v1/responses", {"model": name, "max_output_tokens": 300, "temperature": 0,
                                   "input": "x", "tool_choice": "required",
                                   "tools": [{"type": "function", "name": "get_weather",
                                              "parameters": PARAMS}]}),
            ]  # fmt: skip
            for path, body in bodies:
                for stream in (False, True):
                    sent = {**body, "stream": stream}
                    r = await http.post(path, json=sent)
                    assert check_answer(path, r, sent) == ("streamed" if stream else "answered")
                    marker = {"/v1/chat/completions": '"tool_calls"',
                              "/v1/messages": '"tool_use"',
                              "/v1/responses": '"function_call"'}[path]  # fmt: skip
                    assert marker in r.text
