"""The Anthropic SDKs' tool runners, end to end: anthropic-python's
`client.beta.messages.tool_runner` and anthropic-typescript's `toolRunner` (tests/js,
installed by ./dev.sh where npm is) each send `thread: {"type": "create"}` first; the
server keeps no threads and refuses it with the code on which both runners send the turn
again, whole, without it (docs/api.md, "Message threads"), and the loop goes on: the
model calls the tool, the runner runs it and sends its result, the model answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import pytest
import trio
from server import serve

HANG_GUARD_S = 300  # a machine five times slower than this one
JS = Path(__file__).parent / "js"
QUESTION = [{"role": "user", "content": "weather in Paris?"}]
# An enum: a random model's argument ends within the budget.
CITY = {"type": "string", "enum": ["Paris", "Rome"]}


def _turns(records: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The /v1/messages requests' outcomes in order: (event, status)."""
    return [
        (r["event"], r.get("status", 200))
        for r in records
        if r.get("endpoint") == "/v1/messages"
        and r["event"] in ("request_done", "request_rejected", "request_error")
    ]


async def test_a_thread_is_refused_with_the_code_the_runners_act_on(
    roomy_gguf: Path, tmp_path: Path
) -> None:
    body = {"model": "tiny-test-llama", "max_tokens": 4, "messages": QUESTION,
            "thread": {"type": "create"}}  # fmt: skip
    with trio.fail_after(HANG_GUARD_S):
        async with serve(roomy_gguf, tmp_path) as srv, srv.client() as c:
            r = await c.post("/v1/messages", json=body)
            again = await c.post(
                "/v1/messages",
                json={**body, "thread": {"type": "continue", "previous_message_id": "msg_1"}},
            )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error == {
        "type": "invalid_request_error",
        "message": "thread: message threads are not kept by this server: send the whole "
        "conversation without thread",
        "details": {"error_code": "thread_unsupported_request"},
    }
    assert again.status_code == 400
    assert again.json()["error"]["details"] == {"error_code": "thread_unsupported_request"}


async def test_the_python_tool_runner(roomy_gguf: Path, tmp_path: Path) -> None:
    ran: list[str] = []

    @anthropic.beta_async_tool
    async def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return json.dumps({"city": city, "weather": "sunny"})

    with trio.fail_after(HANG_GUARD_S):
        async with serve(roomy_gguf, tmp_path) as srv:
            client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0)
            runner = client.beta.messages.tool_runner(
                model="tiny-test-llama", max_tokens=400, messages=QUESTION,  # type: ignore[arg-type]
                tools=[get_weather], max_iterations=2, extra_body={"temperature": 0},
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
            )  # fmt: skip
            messages = [m async for m in runner]
    records = srv.log_records()  # once the server has stopped: its log is flushed
    assert [(m.stop_reason, [b.type for b in m.content]) for m in messages] == [
        ("tool_use", ["tool_use"]),
        ("tool_use", ["tool_use"]),
    ]
    assert len(ran) == 2
    assert set(ran) <= {"Paris", "Rome"}
    # The create refused, then the turn whole, then the next one with the tool's result.
    assert _turns(records) == [("request_rejected", 400), ("request_done", 200),
                               ("request_done", 200)]  # fmt: skip


@pytest.mark.skipif(
    shutil.which("node") is None or not (JS / "node_modules" / "@anthropic-ai" / "sdk").is_dir(),
    reason="node or tests/js's packages are missing (./dev.sh installs them where npm is)",
)
async def test_the_typescript_tool_runner(roomy_gguf: Path, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    with trio.fail_after(HANG_GUARD_S):
        async with serve(roomy_gguf, tmp_path) as srv:
            async with httpx.AsyncClient(base_url=srv.url) as c:  # the server is up
                assert (await c.get("/health")).status_code == 200
            done = await trio.run_process(
                [node, str(JS / "tool_runner.mjs"), srv.url], capture_stdout=True,
                capture_stderr=True, check=False,
            )  # fmt: skip
    records = srv.log_records()  # once the server has stopped: its log is flushed
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out["messages"] == [{"stop_reason": "tool_use", "types": ["tool_use"]}] * 2
    assert len(out["ran"]) == 2
    assert set(out["ran"]) <= set(CITY["enum"])
    assert _turns(records) == [("request_rejected", 400), ("request_done", 200),
                               ("request_done", 200)]  # fmt: skip
