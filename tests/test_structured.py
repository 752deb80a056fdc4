"""Structured outputs (OpenAI `response_format`): the output matches the schema by
construction, for any model. Most of this runs on the tiny random-weight model: a model
that knows nothing still writes schema-valid JSON, because every step's logits are
masked by the grammar (llguidance) before sampling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
import trio
from server import serve, serve_model


class Forecast(pydantic.BaseModel):
    """Bounded fields: the answer must end, whatever the weights."""

    model_config = pydantic.ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]
    days: int = pydantic.Field(ge=1, le=14)
    windy: bool
    city: str = pydantic.Field(max_length=6)


async def test_sampled_outputs_of_a_random_model_match_the_schema(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """openai's `chat.completions.parse` with a pydantic model (strict json_schema), sampled
    at temperature 1 with eight seeds: every answer ends by itself (`stop`) and parses
    into the model; the usage counts the tokens."""
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv:
            client = srv.openai("x")
            name = (await client.models.list()).data[0].id
            for seed in range(8):
                r = await client.chat.completions.parse(
                    model=name, messages=[{"role": "user", "content": "the weather"}],
                    response_format=Forecast, max_tokens=200, temperature=1.0, seed=seed,
                )  # fmt: skip
                choice = r.choices[0]
                assert choice.finish_reason == "stop", choice.message.content
                assert isinstance(choice.message.parsed, Forecast)
                assert r.usage is not None
                assert r.usage.completion_tokens > 5


async def test_json_object_and_streaming(tiny_gguf: Path, tmp_path: Path) -> None:
    """json_object gives a JSON object (compact: no free whitespace to wander in); a
    streamed answer's deltas join into the same text as the whole answer."""
    schema = {"name": "f", "strict": True, "schema": Forecast.model_json_schema()}
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = {"model": name, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 120, "temperature": 0}  # fmt: skip
            any_object = {**body, "response_format": {"type": "json_object"}}
            r = await http.post("/v1/chat/completions", json=any_object)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            assert text.startswith("{")
            if r.json()["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(text), dict)
            fmt = {"type": "json_schema", "json_schema": schema}
            whole = await http.post("/v1/chat/completions", json={**body, "response_format": fmt})
            assert whole.status_code == 200, whole.text
            expected = whole.json()["choices"][0]["message"]["content"]
            Forecast.model_validate_json(expected)
            parts = []
            streamed = {**body, "response_format": fmt, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=streamed) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        parts.append(delta.get("content") or "")
            assert "".join(parts) == expected


def longest_digit_run_outside_strings(text: str) -> int:
    """The most digits in a row in a JSON text (complete or not), strings left out."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string, escaped = (ch != '"' or escaped), (ch == "\\" and not escaped)
        elif ch.isdigit():
            run += 1
            longest = max(longest, run)
        else:
            run, in_string = 0, ch == '"'
    return longest


class Reading(pydantic.BaseModel):
    """A plain model: pydantic writes no `additionalProperties` for it."""

    station: int
    celsius: float


async def test_a_plain_schema_gets_its_keys_and_numbers_that_end(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """A schema as pydantic writes it (JSON Schema's open object) and `json_object`,
    sampled from the random-weight model at temperature 1: only the declared keys come
    back, and no number has more than 15 digits before or after its point, whatever
    the weights want (docs/api.md, Structured outputs)."""
    plain = {"type": "json_schema",
             "json_schema": {"name": "r", "schema": Reading.model_json_schema()}}  # fmt: skip
    assert "additionalProperties" not in plain["json_schema"]["schema"]  # type: ignore[index]
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            for fmt in (plain, {"type": "json_object"}):
                for seed in range(6):
                    r = await http.post("/v1/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": "reading"}],
                        "max_tokens": 200, "temperature": 1.0, "seed": seed,
                        "response_format": fmt})  # fmt: skip
                    assert r.status_code == 200, r.text
                    text = r.json()["choices"][0]["message"]["content"]
                    assert longest_digit_run_outside_strings(text) <= 15, text
                    if fmt is plain:
                        assert r.json()["choices"][0]["finish_reason"] == "stop", text
                        assert Reading.model_validate_json(text)
                        assert set(json.loads(text)) == {"station", "celsius"}


async def test_a_constrained_row_is_the_same_alone_and_batched(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The mask is applied to the request's own row: a seeded constrained request gets the
    same answer alone and decoded together with seven others (constrained or not)."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "f", "schema": Forecast.model_json_schema()}}  # fmt: skip
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]

            def body(seed: int, constrained: bool) -> dict[str, object]:
                b: dict[str, object] = {
                    "model": name, "messages": [{"role": "user", "content": "weather"}],
                    "max_tokens": 60, "temperature": 1.0, "seed": seed,
                }  # fmt: skip
                return {**b, "response_format": fmt} if constrained else b

            alone = await http.post("/v1/chat/completions", json=body(7, True))
            answers: dict[int, str] = {}

            async def one(i: int) -> None:
                r = await http.post(
                    "/v1/chat/completions", json=body(7 if i == 0 else i, i % 2 == 0)
                )
                answers[i] = r.json()["choices"][0]["message"]["content"]

            async with trio.open_nursery() as n:
                for i in range(8):
                    n.start_soon(one, i)
    assert answers[0] == alone.json()["choices"][0]["message"]["content"]
    for i in range(0, 8, 2):
        if answers[i].endswith("}"):
            Forecast.model_validate_json(answers[i])


async def test_the_responses_api_text_format(tiny_gguf: Path, tmp_path: Path) -> None:
    """openai's `responses.parse` with a pydantic model (text.format json_schema): the
    output parses, the Response echoes the format; json_object gives an object; a
    format without a name is refused naming text.format.name."""
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv:
            client = srv.openai("x")
            name = (await client.models.list()).data[0].id
            r = await client.responses.parse(
                model=name, input="the weather", text_format=Forecast, max_output_tokens=200,
                temperature=1.0,
            )  # fmt: skip
            assert r.status == "completed"
            assert isinstance(r.output_parsed, Forecast)
            assert r.text.format is not None
            assert r.text.format.type == "json_schema"
            plain = await client.responses.create(
                model=name, input="x", max_output_tokens=120, temperature=0,
                text={"format": {"type": "json_object"}},
            )  # fmt: skip
            assert plain.output_text.startswith("{")
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(
                    model=name, input="x", max_output_tokens=16,
                    text={"format": {"type": "json_schema", "schema": {"type": "object"}}},  # type: ignore[typeddict-item]
                )  # fmt: skip
            assert e.value.param == "text.format.name"


@pytest.mark.parametrize(
    ("fmt", "param", "words"),
    [
        ({"type": "xml"}, "response_format.type", "not a type"),
        ({"type": "json_schema"}, "response_format.json_schema", "needs json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}},
         "response_format.json_schema.name", "name is required"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schemas": {}}},
         "response_format.json_schema.schemas", "unknown field"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}},
         "response_format.json_schema.schema", "cannot be enforced: not"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frobnicate"}}},
         "response_format.json_schema.schema", "not a JSON Schema that can be enforced"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#"}}},
         "response_format.json_schema.schema", "not a JSON Schema that can be enforced"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a"}}},
         "response_format.json_schema.schema", "not a JSON Schema that can be enforced"),
    ],
    ids=["no-type", "no-json-schema", "no-name", "unknown-field", "unsupported", "invalid",
         "ref-self", "ref-loop"],
)  # fmt: skip
async def test_formats_that_cannot_be_honoured_are_refused_by_name(
    tiny_gguf: Path, tmp_path: Path, fmt: dict[str, object], param: str, words: str
) -> None:
    with trio.fail_after(60):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            r = await http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4, "response_format": fmt})  # fmt: skip
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert "frobnicate" not in r.text  # the client's text is not echoed


async def test_a_schema_past_the_grammar_engines_limits_is_a_400(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """An anyOf of 3,000 objects compiles, but llguidance stops where decoding reaches
    it (a row of at most 2,000 items): answered 400 naming the schema, whole or as the
    stream's error event, where it was a 500 internal_error, and counted as a refusal,
    not a server fault; the server goes on."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                         "required": [f"k{i}"]} for i in range(3000)]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    with trio.fail_after(120):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = {"model": name, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 16, "response_format": fmt}  # fmt: skip
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == (
                "invalid_request_error",
                "response_format.json_schema.schema",
            )
            assert "grammar engine" in error["message"]
            streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
            assert streamed.status_code == 200
            assert "response_format.json_schema.schema" in streamed.text
            assert "internal_error" not in streamed.text
            ok = await http.post("/v1/chat/completions", json={**body, "response_format": None})
            assert ok.status_code == 200
            # The client's fault: a refusal in the metrics, not a failure of the server.
            metrics = (await http.get("/metrics")).text
            assert "\nninfer_request_errors_total 0.0\n" in metrics
            assert 'ninfer_request_rejections_total{status="400",type="invalid_request"} 2.0' in (
                metrics
            )
    records = [r for r in srv.log_records() if r["event"] == "request_error"]
    assert [r["status"] for r in records] == [400, 400]


@pytest.mark.realmodel
async def test_the_default_model_answers_in_the_schema(real_gguf: Path, tmp_path: Path) -> None:
    """SmolLM2 through the SDK's parse: a greedy answer that is right as well as valid."""
    with trio.fail_after(300):
        async with serve(real_gguf, tmp_path) as srv:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            name = (await client.models.list()).data[0].id
            r = await client.chat.completions.parse(
                model=name, response_format=Forecast, max_tokens=80, temperature=0,
                messages=[{"role": "user",
                           "content": "Weather in Paris for 3 days in celsius, as JSON."}],
            )  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert parsed is not None
    assert (parsed.unit, parsed.days) == ("celsius", 3)


async def test_schemas_compile_off_the_event_loop(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large schema takes llguidance hundreds of milliseconds (1.5 MB: ~0.3 s here), and
    as much again to build the engine's matcher: both are done on a worker thread, never
    on the thread that serves every connection nor on the engine's, which decodes every
    row (the engine copies the matcher for the row)."""
    import threading

    from ninfer.engine import _engine, _grammar
    from ninfer.frontends import _grammar as grammars

    seen: list[str] = []
    real = grammars.json_schema_grammar

    def spy(schema: dict[str, object], *, param: str, think: bool = False) -> str:
        seen.append(threading.current_thread().name)
        return real(schema, param=param, think=think)

    monkeypatch.setattr(grammars, "json_schema_grammar", spy)
    compiled_on: list[int] = []
    engine_threads: set[int] = set()
    real_compile, real_admit = _grammar.Constraint.compile, _engine.Engine._admit

    def compile_spy(tokenizer: object, grammar: str) -> object:
        compiled_on.append(threading.get_ident())
        return real_compile(tokenizer, grammar)  # type: ignore[arg-type]

    def admit_spy(self: _engine.Engine, *args: Any) -> None:
        engine_threads.add(threading.get_ident())
        real_admit(self, *args)

    monkeypatch.setattr(_grammar.Constraint, "compile", staticmethod(compile_spy))
    monkeypatch.setattr(_engine.Engine, "_admit", admit_spy)
    with trio.fail_after(60):
        async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as http:
            loop_thread = threading.current_thread().name
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            for route, body in (
                ("/v1/chat/completions", {"model": name, "max_tokens": 4,
                 "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_object"}}),
                ("/v1/responses", {"model": name, "input": "x", "max_output_tokens": 16,
                 "text": {"format": {"type": "json_object"}}}),
                ("/v1/generate", {"prompt": "x", "max_new_tokens": 4,
                 "json_schema": {"type": "object"}}),
            ):  # fmt: skip
                r = await http.post(route, json=body)
                assert r.status_code == 200, r.text
    assert len(seen) == 3
    assert loop_thread not in seen
    assert len(compiled_on) == 3
    assert engine_threads
    assert not engine_threads & set(compiled_on)
