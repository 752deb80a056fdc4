"""Property-based requests from the OpenAPI document against a real server: whatever the
body, no 5xx; every 2xx answer (and every stream event) validates strictly against the
documented schema; every error has the route's documented envelope."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from contract import check_answer, from_schema, request_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server import serve

ROUTES = [
    "/v1/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
]
REFUSED = ("logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "thinking",
           "echo", "suffix", "best_of", "n", "logit_bias", "metadata", "modalities",
           "background", "include", "reasoning", "truncation", "text",
           "previous_response_id",
           # llama-server's fields whose random values are mostly refused: a random
           # schema, sampler orders ninfer cannot follow, reasoning on a model without
           # it (the tiny model's template cannot think), a second budget beside max_tokens
           "json_schema", "samplers", "reasoning_format", "reasoning_effort",
           "chat_template_kwargs", "n_predict")  # fmt: skip
BUDGET_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


def _tamed(path: str, model: str) -> dict[str, Any]:
    """The route's request schema with small outputs and, mostly, the served model."""
    schema = request_schema(path)
    props = schema["properties"]
    for name in BUDGET_FIELDS:
        if name in props:
            props[name] = {"type": "integer", "minimum": 1, "maximum": 4}
    if "model" in props:
        props["model"] = {"const": model}
    if path in ("/v1/chat/completions", "/v1/completions"):
        # Without one, the budget is what the context leaves (hundreds of tokens from the
        # random test model): the missing field is fuzzed by the wrong-field bodies.
        schema["required"] = sorted({*schema.get("required", ()), "max_tokens"})
    if path == "/v1/completions":
        props["prompt"] = {"type": "string", "minLength": 1}
    if path == "/v1/responses":
        # Items of random roles and parts are mostly refused; the wrong-field bodies
        # send them. The budget's floor is 16.
        props["input"] = {"type": "string", "minLength": 1}
        props["max_output_tokens"] = {"type": "integer", "minimum": 16, "maximum": 18}
        schema["required"] = sorted({*schema.get("required", ()), "max_output_tokens"})
    # Features refused by name (docs/api.md), and fields whose random values are mostly
    # refused (n past the running slots, logit_bias keys, metadata values), would make
    # nearly every body a refusal;
    # the wrong-field bodies below still send them.
    for name in REFUSED:
        props.pop(name, None)
    if "messages" in props:
        # Conversations the chat template takes: one user turn (roles and their order
        # are fuzzed by the wrong-field bodies).
        # A user turn has text: its content parts, calls and reasoning (an assistant's)
        # are fuzzed by the wrong-field bodies too; and one budget field, as the two
        # must agree.
        item = props["messages"]["items"]
        item["properties"]["role"] = {"const": "user"}
        item["properties"]["content"] = {"type": "string"}
        item["required"] = ["role", "content"]
        for extra in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            item["properties"].pop(extra, None)
        props["messages"]["maxItems"] = 1
        props.pop("max_completion_tokens", None)
    return schema


@pytest.mark.parametrize("path", ROUTES)
async def test_fuzz_route(path: str, tiny_gguf: Path, tmp_path: Path) -> None:
    seen: Counter[str] = Counter()
    async with serve(tiny_gguf, tmp_path, max_pending_requests=64, default_max_tokens=4) as srv:
        valid = from_schema(_tamed(path, srv.app.lifespan.public_id))

        def run() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as client:

                def post(body: Any) -> None:
                    try:
                        raw = orjson.dumps(body)
                    except TypeError:  # an integer past 64 bits: sent all the same
                        raw = json.dumps(body).encode()
                    r = client.post(path, content=raw,
                                    headers={"content-type": "application/json"})  # fmt: skip
                    seen[check_answer(path, r, body)] += 1

                @settings(max_examples=70, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))  # fmt: skip
                @given(valid)
                def schema_valid(body: dict[str, Any]) -> None:
                    post(body)

                @settings(max_examples=50, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))  # fmt: skip
                @given(valid, st.data())
                def one_field_wrong(body: dict[str, Any], data: st.DataObject) -> None:
                    name = data.draw(st.sampled_from(sorted(_tamed(path, "m")["properties"])))
                    body[name] = data.draw(JSON_VALUES)
                    post(body)

                schema_valid()
                one_field_wrong()

        await trio.to_thread.run_sync(run)
    # The schema-valid bodies are mostly served, not refused.
    assert seen["answered"] + seen["streamed"] >= 20, seen
