"""The probe table against real servers: every awkward request gets its documented answer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from server import serve

from ninfer.tools._probes import PROBES, ProbeEnv, ProbeResult, run_probes

TERMINAL = {"request_done", "request_rejected", "request_error", "request_cancelled"}


def _report(results: list[ProbeResult]) -> str:
    return "\n".join(f"{r.probe.name}: {r.problems}" for r in results if not r.ok)


def test_the_table_is_large_and_names_are_unique() -> None:
    assert len(PROBES) >= 80
    names = Counter(p.name for p in PROBES)
    assert [n for n, c in names.items() if c > 1] == []
    routes = Counter(p.route for p in PROBES)
    assert all(routes[r] >= 20 for r in ("native", "chat", "completions", "messages"))


async def test_every_probe_gets_its_documented_answer(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, api_key="probe-key") as srv:
        env = ProbeEnv(model=srv.app.lifespan.public_id, api_key="probe-key")
        results = await run_probes(srv.url, env)
    assert all(r.skipped is None for r in results)
    assert all(r.ok for r in results), _report(results)
    records = srv.log_records()
    assert not [r for r in records if r["event"] == "request_error"]
    terminal = Counter(r["request_id"] for r in records if r["event"] in TERMINAL)
    assert [rid for rid, n in terminal.items() if n != 1] == []


async def test_probes_skip_what_needs_a_key_when_there_is_none(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    async with serve(tiny_gguf, tmp_path) as srv:
        env = ProbeEnv(model=srv.app.lifespan.public_id)
        only = tuple(p for p in PROBES if p.route == "native" or p.status == 401)
        results = await run_probes(srv.url, env, probes=only)
    assert all(r.ok for r in results), _report(results)
    skipped = [r for r in results if r.skipped]
    assert skipped
    assert all(r.probe.status == 401 for r in skipped)


async def test_probes_on_a_model_without_a_chat_template(tmp_path: Path) -> None:
    """A base model (Gemma 3 270M ships no template): `ninfer probe` finds out from the
    chat route's error code and skips what needs a rendered chat; every other chat
    probe still gets its documented answer, because the body is checked whole (model
    name, fields, n, logit_bias) before the missing template is reported."""
    import sys

    import trio
    from tinymodel import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "base.gguf", chat_template=False)
    async with serve(model, tmp_path, api_key="probe-key") as srv:
        done = await trio.run_process(
            [sys.executable, "-m", "ninfer", "probe", srv.url, "--api-key", "probe-key"],
            capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 0, err[-3000:]
    assert "skipped: the model has no chat template" in err
    assert "FAIL" not in err


@pytest.mark.realmodel
async def test_probes_against_the_default_model(real_gguf: Path, tmp_path: Path) -> None:
    async with serve(real_gguf, tmp_path, api_key="probe-key") as srv:
        env = ProbeEnv(model=srv.app.lifespan.public_id, api_key="probe-key")
        results = await run_probes(srv.url, env)
    assert all(r.ok for r in results), _report(results)


def test_the_readme_counts_the_probes() -> None:
    """The README says how many requests `ninfer probe` sends: kept true."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = re.search(r"`ninfer probe` sends (\d+) awkward requests", readme)
    assert said is not None
    assert int(said.group(1)) == len(PROBES)
