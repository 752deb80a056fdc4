"""--kv-capacity auto: the largest pool of whole pages that fits in the memory left after
the weights with 1 GiB kept free, its ledger in server_start and on the console; an
explicit capacity never reduced; a pool smaller than one sequence refused at start-up."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch
from conftest import HANG_GUARD_S, CollectingSink, start_engine, stop_engine
from server import serve

from ninfer._cli import build_parser
from ninfer._config import ConfigError, build_config, config_from_namespace
from ninfer.engine import KV_HEADROOM_BYTES, EngineConfig, _startup
from ninfer.engine._contract import KV_MEMORY_FLOOR_BYTES
from ninfer.engine._engine import Engine
from ninfer.engine._loader import load_model
from ninfer.engine._memory import _cgroup_room, available_memory

# The tiny model: keys and values (2) x 2 layers x 2 kv heads x head dim 16, float16 (2:
# --kv-dtype auto beside float32 activations).
PER_TOKEN = 2 * 2 * 2 * 16 * 2  # 256 bytes
PAGE = 16


def _memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    monkeypatch.setattr(_startup, "available_memory", lambda _d: (available, "test"))


def _start_fails(path: Path, config: EngineConfig) -> BaseException:
    """Run an engine expected to refuse to start; what it raised."""
    engine = Engine(
        lambda: load_model(str(path), dtype=torch.float32, device="cpu", max_positions=8192),
        config,
        CollectingSink(),
    )
    raised: list[BaseException] = []

    def target() -> None:
        try:
            engine.run(on_ready=lambda _m: None)
        except BaseException as exc:  # the thread's end: kept for the test
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive()
    (exc,) = raised
    return exc


def test_auto_takes_every_whole_page_that_fits_beside_the_headroom(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = 1000  # what fits, padding and scratch pages included
    _memory(monkeypatch, KV_HEADROOM_BYTES + pages * PAGE * PER_TOKEN + PER_TOKEN * PAGE - 1)
    running = start_engine(tiny_gguf, EngineConfig(kv_capacity="auto", max_context=256))
    try:
        served = running.engine.served()
        sizing = served.kv_sizing
        assert sizing is not None
        assert (sizing.mode, sizing.bytes_per_token) == ("auto", PER_TOKEN)
        assert sizing.tokens == (pages - 2) * PAGE  # two pages are the pool's own
        assert served.kv_pages == pages - 2
        assert sizing.pool_bytes == pages * PAGE * PER_TOKEN
        assert sizing.pool_bytes + sizing.headroom_bytes <= sizing.available_bytes
        assert sizing.headroom_bytes == KV_HEADROOM_BYTES
    finally:
        stop_engine(running)


def test_auto_refuses_a_pool_smaller_than_one_sequence(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _memory(monkeypatch, KV_HEADROOM_BYTES + 10 * PAGE * PER_TOKEN)  # 8 pages: 128 tokens
    exc = _start_fails(tiny_gguf, EngineConfig(kv_capacity="auto", max_context=256))
    assert isinstance(exc, ConfigError)
    assert str(exc).startswith("--kv-capacity auto: 1.00 GiB are free after the weights (test)")
    said = f"128 tokens fit ({PER_TOKEN} bytes each), fewer than one sequence of 256 "
    assert said + "(--max-context): free memory or lower --max-context" in str(exc)


def test_an_explicit_capacity_is_never_reduced(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever memory there is, the pool asked for is the pool served (to whole pages),
    with nothing kept free on its behalf; one that cannot fit at all is refused."""
    _memory(monkeypatch, KV_HEADROOM_BYTES)
    running = start_engine(tiny_gguf, EngineConfig(kv_capacity=1000))
    try:
        sizing = running.engine.served().kv_sizing
        assert sizing is not None
        assert (sizing.mode, sizing.tokens, sizing.headroom_bytes) == ("explicit", 1008, 0)
    finally:
        stop_engine(running)
    _memory(monkeypatch, 100 * PAGE * PER_TOKEN)
    exc = _start_fails(tiny_gguf, EngineConfig(kv_capacity=200 * PAGE))
    assert isinstance(exc, ConfigError)
    assert str(exc) == (
        f"--kv-capacity 3200 needs 0.8 MiB for its KV pool ({PER_TOKEN} bytes a token); "
        "0.4 MiB are free after the weights (test): lower it, or give auto"
    )


async def test_a_server_shows_the_ledger(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _memory(monkeypatch, KV_HEADROOM_BYTES + 600 * PAGE * PER_TOKEN)
    async with serve(tiny_gguf, tmp_path, kv_capacity="auto", max_context=512) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            ok = await c.post("/v1/generate", json={"prompt": "hi", "max_new_tokens": 3})
        assert ok.status_code == 200
        records = srv.log_records()
    (start,) = [r for r in records if r["event"] == "server_start"]
    assert start["config"]["kv_capacity"] == "auto"
    assert start["engine"]["kv_pages"] == 598
    assert start["engine"]["kv_sizing"] == {
        "mode": "auto", "kv_dtype": "float16", "tokens": 598 * PAGE, "bytes_per_token": PER_TOKEN,
        "pool_bytes": 600 * PAGE * PER_TOKEN, "available_bytes": KV_HEADROOM_BYTES + 600 * PAGE
        * PER_TOKEN, "memory_source": "test", "headroom_bytes": KV_HEADROOM_BYTES,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--kv-capacity", "auto"], {}, "auto"),
        ([], {"NINFER_KV_CAPACITY": "auto"}, "auto"),
        (["--kv-capacity", "4096"], {"NINFER_KV_CAPACITY": "auto"}, 4096),
    ],
)
def test_auto_is_a_value_of_the_flag_and_the_variable(
    argv: list[str], env: dict[str, str], expected: object
) -> None:
    cfg = config_from_namespace(build_parser().parse_args(["serve", *argv]), env)
    assert cfg.kv_capacity == expected


def test_other_words_are_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="--kv-capacity must be an integer or auto, got 'lots'"):
        config_from_namespace(build_parser().parse_args(["serve", "--kv-capacity", "lots"]), {})
    with pytest.raises(ConfigError, match="NINFER_KV_CAPACITY must be an integer or auto"):
        config_from_namespace(build_parser().parse_args(["serve"]), {"NINFER_KV_CAPACITY": "x"})
    with pytest.raises(ConfigError, match="kv_capacity must be an integer or auto"):
        build_config({"kv_capacity": "max"}, {"kv_capacity": "kv_capacity"})


def test_the_memory_left_is_read_from_the_machine() -> None:
    available, source = available_memory("cpu")
    assert source in ("MemAvailable", "cgroup memory limit", "free physical pages")
    total = Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]
    assert 0 < available <= int(total) * 1024


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_limit_bounds_it(tmp_path: Path, version: int) -> None:
    """A container's (or a systemd unit's) memory limit less what the cgroup uses."""
    cgroup = tmp_path / "cgroup"
    if version == 2:
        folder = cgroup / "system.slice" / "ninfer.service"
        membership = "0::/system.slice/ninfer.service\n"
        limit, usage = "memory.max", "memory.current"
    else:
        folder = cgroup / "memory" / "docker" / "abc"
        membership = "4:memory:/docker/abc\n0::/\n"
        limit, usage = "memory.limit_in_bytes", "memory.usage_in_bytes"
    folder.mkdir(parents=True)
    (tmp_path / "self").write_text(membership)
    (folder / limit).write_text(f"{8 << 30}\n")
    (folder / usage).write_text(f"{3 << 30}\n")
    assert _cgroup_room(cgroup, tmp_path / "self") == 5 << 30
    (folder / limit).write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")  # no limit
    assert _cgroup_room(cgroup, tmp_path / "self") is None


@pytest.mark.parametrize("version", [1, 2])
def test_inside_a_container_the_tail_of_the_path_is_found_and_parents_bound_it(
    tmp_path: Path, version: int
) -> None:
    """In a container the hierarchy is mounted at the container's own cgroup, while
    /proc/self/cgroup names the host's path to it: the path's tail is where the folder
    is. A parent's limit bounds its children (the least room of the chain counts)."""
    cgroup = tmp_path / "cgroup"
    if version == 2:
        mount = cgroup
        membership = "0::/kubepods/pod1/ctr/ninfer\n"
        limit, usage = "memory.max", "memory.current"
    else:
        mount = cgroup / "memory"
        membership = "4:memory:/kubepods/pod1/ctr/ninfer\n"
        limit, usage = "memory.limit_in_bytes", "memory.usage_in_bytes"
    child = mount / "ninfer"
    child.mkdir(parents=True)
    (tmp_path / "self").write_text(membership)
    (child / limit).write_text(f"{8 << 30}\n")
    (child / usage).write_text(f"{1 << 30}\n")
    (mount / limit).write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")
    (mount / usage).write_text(f"{1 << 30}\n")
    assert _cgroup_room(cgroup, tmp_path / "self") == 7 << 30
    (mount / limit).write_text(f"{4 << 30}\n")  # the container's own limit is tighter
    assert _cgroup_room(cgroup, tmp_path / "self") == 3 << 30


async def test_pages_the_memory_cannot_hold_are_not_taken(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the pool is sized, other processes may take the memory its untouched pages
    would need: the pool then serves from the pages it has touched, a request that needs
    more while none is held is refused 503 with Retry-After (the server lives on), and
    once the memory is back it is served."""
    spare_pages = [1000]  # beside KV_MEMORY_FLOOR_BYTES, in the fake machine
    monkeypatch.setattr(
        _startup,
        "available_memory",
        lambda _d: (KV_MEMORY_FLOOR_BYTES + spare_pages[0] * PAGE * PER_TOKEN, "test"),
    )
    monkeypatch.setattr(_startup, "MEMORY_READ_EVERY_S", 0.0)
    small = {"prompt": "hi", "max_new_tokens": 40, "temperature": 0}
    large = {"prompt": "hi", "max_new_tokens": 400, "temperature": 0}
    async with (
        serve(tiny_gguf, tmp_path, kv_capacity=256 * PAGE) as srv,
        httpx.AsyncClient(base_url=srv.url, timeout=60) as c,
    ):
        first = await c.post("/v1/generate", json=small)
        assert first.status_code == 200, first.text
        spare_pages[0] = 0  # another process took it
        # Served from the pages touched before (another prompt: none of the first's
        # cached pages is lent, which would hold one more page).
        again = await c.post("/v1/generate", json={**small, "prompt": "ok"})
        assert again.status_code == 200, again.text
        refused = await c.post("/v1/generate", json=large)  # 26 pages: never touched
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "5"
        error = refused.json()["error"]
        assert error["type"] == "engine_unavailable"
        assert error["message"] == (
            "the server has no memory left for this request's KV cache; retry later"
        )
        assert (await c.get("/health")).status_code == 200
        spare_pages[0] = 1000  # and it is back
        served = await c.post("/v1/generate", json=large)
        assert served.status_code == 200, served.text
    records = srv.log_records()  # once the server has stopped: its log is flushed
    (failed,) = [r for r in records if r["event"] == "request_error"]
    assert failed["status"] == 503
    assert failed["type"] == "engine_unavailable"
