"""The OpenAI Responses core through the official openai SDK (and raw HTTP where the SDK
hides the wire): create, stream, retrieve, input Items, delete, continuation through
previous_response_id, token counts, refusals; every answer checked against the
OpenAPI document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import trio
from contract import response_validator, stream_validators
from server import SERVER_HANG_GUARD_S, serve, serve_app, serve_model, validate_log

NAMES = ["tiny", "gpt-4.1-mini"]
INSTRUCTIONS = "You are a careful assistant who answers in one short sentence, always."


async def test_create_retrieve_list_delete(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv:
        client = srv.openai()
        first = await client.responses.create(
            model="gpt-4.1-mini",
            instructions=INSTRUCTIONS,
            input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
            ],
            max_output_tokens=16,
            temperature=0,
        )
        assert first.id.startswith("resp_")
        assert first.object == "response"
        assert first.model == "gpt-4.1-mini"
        assert first.status in ("completed", "incomplete")
        (item,) = first.output
        assert item.type == "message"
        assert item.role == "assistant"
        assert first.output_text == item.content[0].text  # the SDK's helper
        assert first.usage is not None
        assert first.usage.output_tokens <= 16
        assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
        if first.status == "incomplete":
            assert first.incomplete_details is not None
            assert first.incomplete_details.reason == "max_output_tokens"
        assert first.instructions == INSTRUCTIONS
        assert first.store is True

        again = await client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()

        items = await client.responses.input_items.list(first.id, order="asc")
        assert [(i.type, i.role) for i in items.data] == [  # type: ignore[union-attr]
            ("message", "developer"), ("message", "user")]  # fmt: skip
        assert items.data[1].content[0].text == "Hello there"  # type: ignore[union-attr]
        newest = await client.responses.input_items.list(first.id, limit=1)
        assert [i.id for i in newest.data] == [items.data[1].id]
        assert newest.has_more is True

        # The continuation reuses the first prompt's pages: its conversation begins with
        # the same instructions and Items.
        second = await client.responses.create(
            model="tiny",
            instructions=INSTRUCTIONS,
            previous_response_id=first.id,
            input="And again?",
            max_output_tokens=16,
            temperature=0,
        )
        assert second.previous_response_id == first.id
        assert second.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert second.usage.input_tokens_details.cached_tokens >= 16

        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.retrieve(first.id)
        assert e.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model="tiny", input="x", previous_response_id=first.id)
        assert e.value.param == "previous_response_id"
        # The second still continues: its history was kept with it.
        third = await client.responses.create(
            model="tiny", input="Once more.", previous_response_id=second.id, max_output_tokens=16
        )
        assert third.status in ("completed", "incomplete")

        unstored = await client.responses.create(
            model="tiny", input="x", store=False, max_output_tokens=16
        )
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)

        counted = await client.responses.input_tokens.count(
            model="tiny", instructions=INSTRUCTIONS, input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        )  # fmt: skip
        assert counted.input_tokens == first.usage.input_tokens

        async with srv.client() as c:
            raw = await c.get(f"/v1/responses/{second.id}")
            response_validator("/v1/responses/{response_id}", 200, "get").validate(raw.json())
            raw = await c.get(f"/v1/responses/{second.id}/input_items")
            response_validator("/v1/responses/{response_id}/input_items", 200, "get").validate(
                raw.json()
            )


async def test_stream_events_in_order(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve_model(tiny_gguf, tmp_path, served_model_name=NAMES) as srv:
        client = srv.openai()
        async with client.responses.stream(
            model="tiny", input="Tell me a story.", max_output_tokens=20, temperature=0
        ) as stream:
            events = [event async for event in stream]
        # 20 tokens of the random test model: cut by max_output_tokens, so the terminal
        # event is response.incomplete (the SDK's get_final_response() wants completed).
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]  # fmt: skip
        assert kinds[-4:] == [
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete"]  # fmt: skip
        final = events[-1].response  # type: ignore[union-attr]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text
        assert final.usage is not None
        assert final.usage.output_tokens == 20
        assert (await client.responses.retrieve(final.id)).output_text == final.output_text

        # On the wire: every frame's event name is its type, each validates, no [DONE].
        async with srv.client() as c:
            body = {"model": "tiny", "input": "Hi", "max_output_tokens": 16, "stream": True}
            r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200
        assert "[DONE]" not in r.text
        validators, _ = stream_validators("/v1/responses")
        assert validators is not None
        for block in r.text.strip().split("\n\n"):
            lines = dict(line.split(": ", 1) for line in block.splitlines())
            data = orjson.loads(lines["data"])
            assert data["type"] == lines["event"]
            validators[lines["event"]].validate(data)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type",
         "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "unsupported_parameter"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_parameter"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"max_output_tokens": 8}, "max_output_tokens", "invalid_value"),
        ({"metadata": {"k": "v" * 600}}, "metadata", "invalid_value"),
        ({"beam_width": 4}, "beam_width", "unknown_parameter"),
        ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type",
         "unsupported_parameter"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
         "input[0].encrypted_content", "unsupported_parameter"),
        ({"input": [{"type": "reasoning", "content": []}]}, "input[0].summary",
         "missing_required_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", "unsupported_parameter"),
        ({"input": [{"role": "user", "content": "a", "id": "m1"},
                    {"role": "user", "content": "b", "id": "m1"}]}, "input[1].id",
         "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": [{"role": "user", "content": "a", "call_id": "c1"}]}, "input[0].call_id",
         "unknown_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a",
                                                   "file_id": "f"}]}]},
         "input[0].content[0].file_id", "unsupported_parameter"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "response_not_found"),
    ],
)  # fmt: skip
async def test_refusals_name_the_field(
    tmp_path: Path, body: dict[str, Any], param: str, code: str
) -> None:
    """What the Responses codec and frontend refuse, by name (the app over a fake engine,
    whose chat template cannot think)."""
    async with serve_app(tmp_path, served_model_name=NAMES) as srv, srv.client() as c:
        r = await c.post("/v1/responses", json={"model": "tiny", "input": "x", **body})
        assert r.status_code in (400, 404), r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
        assert r.headers["x-request-id"]


async def test_store_bounds_and_the_routes_that_refuse(tiny_gguf: Path, tmp_path: Path) -> None:
    async with (
        serve_model(tiny_gguf, tmp_path, served_model_name=NAMES, response_store_max_records=2,
              response_store_max_mib=0.004) as srv,
        srv.client() as c,
    ):  # fmt: skip
        ids = []
        for i in range(3):
            r = await c.post("/v1/responses", json={"model": "tiny", "input": f"n{i}",
                                                    "max_output_tokens": 16})  # fmt: skip
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        # Two records at most: the least recently used went first.
        assert (await c.get(f"/v1/responses/{ids[0]}")).status_code == 404
        assert (await c.get(f"/v1/responses/{ids[2]}")).status_code == 200
        # A response that could not be kept even alone is refused, not pretended stored.
        big = await c.post("/v1/responses", json={"model": "tiny", "input": "x" * 300})
        assert big.status_code == 400
        assert big.json()["error"]["code"] == "response_store_capacity_exceeded"
        body = {"model": "tiny", "input": "x" * 300, "store": False, "max_output_tokens": 16}
        assert (await c.post("/v1/responses", json=body)).status_code == 200  # not stored
        cancel = await c.post(f"/v1/responses/{ids[2]}/cancel")
        assert cancel.status_code == 400
        assert cancel.json()["error"]["code"] == "background_not_supported"
        compact = await c.post("/v1/responses/compact", json={})
        assert compact.json()["error"]["code"] == "compaction_not_supported"
        bad = await c.get(f"/v1/responses/{ids[2]}/input_items", params={"limit": "101"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "limit")
        gone = await c.delete("/v1/responses/resp_nope")
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "response_not_found")
        metrics = (await c.get("/metrics")).text
    assert 'route="/v1/responses"' in metrics
    assert 'route="/v1/responses/{response_id}"' in metrics
    validate_log(srv.log_path)
    records = [orjson.loads(line) for line in srv.log_path.read_bytes().splitlines()]
    starts = [r for r in records if r["event"] == "request_start"]
    assert {r["endpoint"] for r in starts} == {"/v1/responses"}
    assert all(r["store"] in (True, False) for r in starts)


async def test_the_store_counts_the_whole_response(tiny_gguf: Path, tmp_path: Path) -> None:
    """A stored Response is counted whole: its `text.format` schema (here a 20 KB
    description) as much as its text. A store of 50 KiB keeps two such Responses, not
    four; one whose schema alone is larger than the store is refused. (Counting only
    texts, 300 such Responses with 3 MB schemas grew a server by 1.2 GB under 64 MiB.)"""

    def body(description: str) -> dict[str, Any]:
        schema = {"type": "object", "description": description}
        fmt = {"type": "json_schema", "name": "x", "schema": schema}
        return {"model": "tiny", "input": "hi", "max_output_tokens": 16, "text": {"format": fmt}}

    async with (
        serve_model(tiny_gguf, tmp_path, served_model_name=NAMES, response_store_max_mib=50 / 1024)
        as srv,
        srv.client() as c,
    ):  # fmt: skip
        ids = []
        for i in range(4):
            r = await c.post("/v1/responses", json=body(str(i) * 20_000))
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        kept = [(await c.get(f"/v1/responses/{i}")).status_code for i in ids]
        assert kept == [404, 404, 200, 200]
        big = await c.post("/v1/responses", json=body("d" * 60_000))
        assert (big.status_code, big.json()["error"]["code"]) == (
            400,
            "response_store_capacity_exceeded",
        )


async def test_a_stream_cut_by_an_engine_failure_ends_with_response_failed(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import FAILING_SEED, plant_sampling_failure

    plant_sampling_failure(monkeypatch, "planted failure")
    # The Responses API has no seed: the server's default seed picks the planted failure.
    async with (
        serve_model(tiny_gguf, tmp_path, served_model_name=NAMES, seed=FAILING_SEED) as srv,
        srv.client() as c,
    ):
        body = {"model": "tiny", "input": "x", "stream": True, "temperature": 1.0,
                "max_output_tokens": 16}  # fmt: skip
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200
    frames = [b for b in r.text.strip().split("\n\n") if b]
    last = dict(line.split(": ", 1) for line in frames[-1].splitlines())
    assert last["event"] == "response.failed"
    data = orjson.loads(last["data"])
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "internal_error"
    assert [orjson.loads(dict(ln.split(": ", 1) for ln in f.splitlines())["data"])
            ["sequence_number"] for f in frames] == list(range(len(frames)))  # fmt: skip


def test_the_sdk_is_what_the_test_drives() -> None:
    """Guard: these tests mean the official SDK's Responses resource."""
    assert hasattr(openai.AsyncOpenAI(api_key="x").responses, "input_items")
    assert httpx  # raw HTTP is used where the SDK hides the wire


def _agents_run(url: str) -> tuple[str, str]:
    """openai-agents (asyncio) driving ninfer through its Responses model, as a user of
    `OpenAIResponsesModel` would; run on its own event loop in a worker thread."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)  # no trace upload: nothing outside this machine

    async def main() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="gpt-4.1-mini", openai_client=client)
        agent = agents.Agent(
            name="assistant",
            instructions=INSTRUCTIONS,
            model=model,
            model_settings=agents.ModelSettings(max_tokens=128, temperature=0.0),
        )
        first = await agents.Runner.run(agent, "Hello there")
        # The next turn continues the first through previous_response_id.
        second = await agents.Runner.run(
            agent, "And again?", previous_response_id=first.last_response_id
        )
        return str(first.final_output), str(second.final_output)

    return asyncio.run(main())


@pytest.mark.realmodel
async def test_openai_agents_runs_on_the_responses_route(real_gguf: Path, tmp_path: Path) -> None:
    """openai-agents takes an incomplete Response (cut by max_output_tokens) for a
    failure: the real model, which ends its answers, is what it runs on."""
    pytest.importorskip("agents")
    async with serve(real_gguf, tmp_path, served_model_name=NAMES) as srv:
        with trio.fail_after(SERVER_HANG_GUARD_S):
            first, second = await trio.to_thread.run_sync(_agents_run, srv.url)
    assert first
    assert second
    records = [orjson.loads(line) for line in srv.log_path.read_bytes().splitlines()]
    starts = [r for r in records if r["event"] == "request_start"]
    assert [r["endpoint"] for r in starts] == ["/v1/responses"] * 2
    assert starts[0]["previous_response_id"] is None
    assert starts[1]["previous_response_id"] is not None
