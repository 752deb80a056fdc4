"""The client examples run, as a user runs them, against the default model: exit 0, the
greedy answers right, the refusal shown where one is meant to be."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import trio
from server import serve

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HANG_GUARD_S = 300


async def _run(*cmd: str, url: str) -> str:
    env = {**os.environ, "NINFER_URL": url}
    env.pop("NINFER_API_KEY", None)
    with trio.fail_after(HANG_GUARD_S):
        done = await trio.run_process(
            list(cmd), capture_stdout=True, capture_stderr=True, check=False, env=env
        )
    out = done.stdout.decode()
    assert done.returncode == 0, (out[-2000:], done.stderr.decode()[-2000:])
    assert "Traceback" not in done.stderr.decode()
    return out


@pytest.mark.realmodel
async def test_the_client_examples_run(real_gguf: Path, tmp_path: Path) -> None:
    async with serve(real_gguf, tmp_path, served_model_name=["smollm2-135m-instruct"]) as srv:
        out = await _run(sys.executable, str(EXAMPLES / "openai_client.py"), srv.url, url=srv.url)
        assert out.splitlines()[0].count("Paris") == 1  # greedy: the right answer
        assert "refused: unsupported_parameter reasoning_effort" in out
        assert "prompt tokens from the cache)" in out  # the Responses continuation ran
        assert 'tool_calls get_weather {"city": "Paris"' in out  # the tool call, parsed
        out = await _run(
            sys.executable, str(EXAMPLES / "anthropic_client.py"), srv.url, url=srv.url
        )
        assert "Paris" in out.splitlines()[1]
        assert "end_turn" in out.splitlines()[1]
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed: examples/curl.sh not run")
        out = await _run("bash", str(EXAMPLES / "curl.sh"), url=srv.url)
        assert "Paris" in out
        assert out.count('"error"') == 1  # only the example that shows an error
        assert '"param":"max_new_tokens"' in out
