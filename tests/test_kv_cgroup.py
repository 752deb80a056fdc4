"""The KV pool under a real cgroup memory limit: a server whose pool was sized when memory
was plentiful, in a cgroup whose limit then drops (what other processes taking the
machine's memory look like to it), serves distinct prompts from the pages it has
touched instead of being killed by the OOM killer. Where no memory cgroup can be made
here (not root, no memory controller, a v2 tree that does not delegate it), skipped:
tests/test_kv_sizing.py checks the same rule with the memory reading replaced."""

from __future__ import annotations

import os
import random
import shlex
import string
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from server import start_process, until_ready
from tinymodel import write_tiny_gguf

from ninfer.engine._contract import KV_MEMORY_FLOOR_BYTES

HANG_GUARD_S = 600  # ten ~1,000-token prompts through a 4-layer model, on a slow machine
MIB = 1 << 20
PROMPTS = 10
PROMPT_CHARS = 1000  # one token a character: the tiny vocabulary's bytes


def _make_cgroup() -> tuple[Path, str, str] | None:
    """A fresh memory cgroup under this process's own: (its folder, the limit file, the
    usage file), or None where none can be made."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    name = f"ninfer-test-{os.getpid()}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: its mount shows our part of the tree
            mount, files = (
                Path("/sys/fs/cgroup/memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            )
        elif controllers == "":
            mount, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for start in range(len(parts) + 1):
            parent = mount.joinpath(*parts[start:])
            if not (parent / "cgroup.procs").is_file():
                continue
            folder = parent / name
            try:
                folder.mkdir()
            except OSError:
                break
            if (folder / files[0]).is_file() and os.access(folder / files[0], os.W_OK):
                return folder, *files
            folder.rmdir()
            break
    return None


@pytest.fixture
def cgroup() -> Iterator[tuple[Path, str, str]]:
    made = _make_cgroup()
    if made is None:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
    yield made
    made[0].rmdir()


def _kv_heavy_model(path: Path) -> Path:
    """A random model whose keys and values take 64 KiB a token in float32 (8 layers x 4
    kv heads x head dim 256 x 2 x 4 bytes; SmolLM2 takes 45 KiB), a page of 16 1 MiB, with
    little else to compute (width 256)."""
    return write_tiny_gguf(
        path, dim=256, n_heads=4, n_kv_heads=4, head_dim=256, n_layers=8, ffn=512, context=2048
    )


async def _drain(proc: trio.Process, console: bytearray) -> None:
    assert proc.stderr is not None
    while chunk := await proc.stderr.receive_some():
        console += chunk


async def _serve_distinct_prompts(
    url: str, folder: Path, limit_file: str, usage_file: str, proc: trio.Process
) -> None:
    rng = random.Random(0)
    prompts = ["".join(rng.choices(string.ascii_lowercase, k=PROMPT_CHARS)) for _ in range(PROMPTS)]
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c:
        await until_ready(c)
        # The pool (1 GiB) was sized against the machine's memory; now the cgroup leaves
        # the server the floor and 160 MiB more: ten distinct prompts of 63 pages each
        # would make 630 MiB resident.
        usage = int((folder / usage_file).read_text())
        limit = usage + KV_MEMORY_FLOOR_BYTES + 160 * MIB
        (folder / limit_file).write_text(str(limit))
        for prompt in prompts:
            r = await c.post(
                "/v1/generate", json={"prompt": prompt, "max_new_tokens": 4, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > PROMPT_CHARS * 0.9  # a few merge
        assert proc.returncode is None
        assert int((folder / usage_file).read_text()) <= limit


async def test_a_limit_that_drops_after_start_up_does_not_kill_the_server(
    tmp_path: Path, cgroup: tuple[Path, str, str]
) -> None:
    folder, limit_file, usage_file = cgroup
    model = _kv_heavy_model(tmp_path / "heavy.gguf")
    serve = [
        sys.executable, "-m", "ninfer", "serve", "--model", str(model), "--port", "0",
        "--kv-capacity", "16384", "--max-context", "2048", "--max-concurrency", "1",
        "--threads", "2", "--request-log-jsonl", str(tmp_path / "requests.jsonl"),
    ]  # fmt: skip
    # The shell joins the cgroup, then becomes the server (its children would too).
    cmd = ["sh", "-c", f"echo $$ > {folder / 'cgroup.procs'} && exec {shlex.join(serve)}"]
    console = bytearray()
    with trio.fail_after(HANG_GUARD_S):
        proc, url = await start_process(cmd, console)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, proc, console)  # the console, read as it comes
                await _serve_distinct_prompts(url, folder, limit_file, usage_file, proc)
                nursery.cancel_scope.cancel()
        finally:
            proc.kill()
            await proc.wait()
    text = console.decode(errors="replace")
    assert "Traceback" not in text
    oom = folder / "memory.oom_control"  # v1: how many processes its OOM killer took
    if oom.is_file():
        kills = [line for line in oom.read_text().splitlines() if line.startswith("oom_kill ")]
        assert kills in ([], ["oom_kill 0"])
