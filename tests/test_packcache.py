"""The native kernels' packed matrices kept between starts (`_packcache`): a start packs
into a file under the cache directory and keeps it, the next start of the same
everything maps it and computes the same bits; a kept pack that is not exactly what
this load would pack is never used."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import start_engine, stop_engine
from tinymodel import write_tiny_gguf

from ninfer.engine import EngineConfig, GenerationRequest, _native, _packcache, _startup
from ninfer.engine._kernels import loaded_library
from ninfer.engine._native import Packed
from ninfer.engine._startup import KV_HEADROOM_BYTES


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4 layers, an odd Q8_0 matrix and a Q8_0 head, as a downloaded file mixes them."""
    return write_tiny_gguf(
        tmp_path_factory.mktemp("packcache") / "m.gguf", packed_layers=True, odd_layer=1
    )


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 KiB: the tiny model's matrices then fill several, and the larger
    ones take buffers of their own, as a large model's do."""
    monkeypatch.setattr(_native.PackArena, "CHUNK", 8192)


def _matrices(model: Any) -> list[Packed]:
    t = model.transformer
    out = [m for layer in t.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    return [*out, t.lm_head]


def _start(path: Path, where: Path | None, lines: list[str] | None = None) -> Any:
    """Served tokens for three prompts, the matrices' bytes and where they came from, and
    the permissions of their maps (packs kept in `where`; None: packed into memory, as
    a start without a cache packs them)."""
    config = EngineConfig(max_batch=4, packed_cache=None if where is None else str(where))
    running = start_engine(path, config, (lines if lines is not None else []).append)
    try:
        model = running.model
        if model.transformer.native is None:
            pytest.skip("the native kernels are not built here")
        handles = [
            running.engine.submit(GenerationRequest(f"r{i}", tuple(range(3 + i, 20 + 3 * i)), 8))
            for i in range(3)
        ]
        running.sink.wait_done(*handles)
        tokens = [running.sink.tokens[h.id] for h in handles]
        matrices = [m.data.clone() for m in _matrices(model)]
        modes = [_mode(m.data) for m in _matrices(model)]
        return tokens, matrices, model.packed_from, modes
    finally:
        stop_engine(running)


def _mode(t: torch.Tensor) -> str:
    """The permissions of the mapping holding `t`'s first byte (/proc/self/maps)."""
    at = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= at < high:
            return perms
    return "?"


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_start_keeps_its_packed_matrices_and_the_next_maps_them(
    model_file: Path, tmp_path: Path, small_chunks: None
) -> None:
    """The first start packs into a file and keeps it; the second maps it: the same
    bytes, matrix for matrix, the same tokens, and the self-check (which runs at every
    start here) passes on the mapped matrices. Both starts' matrices are read-only
    shared maps of the file."""
    where = tmp_path / "packed"
    lines: list[str] = []
    tokens, first, packed_from, modes = _start(model_file, where, lines)
    assert packed_from == ""
    assert any("packed matrices kept for the next start" in line for line in lines)
    (kept,) = where.glob("*.bin")
    assert set(modes) == {"r--s"}
    layout = json.loads(kept.with_suffix(".json").read_text())
    assert len(layout["buffers"]) > 2  # chunks and buffers of their own
    lines.clear()
    again, second, packed_from, modes = _start(model_file, where, lines)
    assert packed_from == str(kept)
    assert any("mapped from" in line for line in lines)
    assert set(modes) == {"r--s"}
    assert _same(first, second)
    assert again == tokens
    assert _start(model_file, where)[2] == str(kept)  # and the next start again
    # and against matrices packed into memory, as a start without a cache packs them
    plain_tokens, plain, _, _ = _start(model_file, None)
    assert _same(first, plain)
    assert plain_tokens == tokens


def _flip_a_byte(kept: Path, layout: dict[str, Any]) -> None:
    """A byte of the first buffer's first 4 KiB changed, the file's times kept (what
    its identity cannot see)."""
    st = kept.stat()
    offset = layout["buffers"][0][0] + 5
    with open(kept, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(kept, ns=(st.st_atime_ns, st.st_mtime_ns))


def _first_part_longer(layout: dict[str, Any]) -> dict[str, Any]:
    (offset, size), *rest = layout["parts"]
    return {**layout, "parts": [[offset, size + 64], *rest]}


SPOILS: dict[str, Callable[[Path, dict[str, Any]], dict[str, Any] | None]] = {
    "another version": lambda _k, layout: {**layout, "version": layout["version"] + 1},
    "the file touched": lambda k, _l: os.utime(k, ns=(1, 1)),
    "a byte changed": lambda k, layout: _flip_a_byte(k, layout),
    "a part's size": lambda _k, layout: _first_part_longer(layout),
    "a part less": lambda _k, layout: {**layout, "parts": layout["parts"][:-1]},
    "the file gone": lambda k, _l: k.unlink(),
    "not JSON": lambda k, _l: k.with_suffix(".json").write_text("{not json") and None,
}


@pytest.mark.parametrize("spoil", SPOILS.values(), ids=SPOILS.keys())
def test_a_kept_pack_this_load_would_not_pack_is_not_used(
    spoil: Callable[[Path, dict[str, Any]], dict[str, Any] | None],
    model_file: Path,
    tmp_path: Path,
    small_chunks: None,
) -> None:
    """A kept pack of another version, whose file changed since it was kept (its times,
    or a byte where its times were put back), whose parts are not the sizes or the
    count this load takes, whose file is gone or whose layout is not JSON, is packed
    again from the model file: the same bytes and tokens, kept anew for the next."""
    where = tmp_path / "packed"
    tokens, first, _, _ = _start(model_file, where)
    (kept,) = where.glob("*.bin")
    meta = kept.with_suffix(".json")
    changed = spoil(kept, json.loads(meta.read_text()))
    if changed is not None:
        meta.write_text(json.dumps(changed))
    again, second, packed_from, _ = _start(model_file, where)
    assert packed_from == ""
    assert _same(first, second)
    assert again == tokens
    _, third, packed_from, _ = _start(model_file, where)
    assert packed_from == str(kept)
    assert _same(first, third)


def test_a_pack_without_room_is_not_kept(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the disk would keep less than the spare room free, the start packs into
    memory and says why nothing is kept; it serves the same tokens."""
    monkeypatch.setattr(_packcache, "_SPARE", 1 << 62)
    lines: list[str] = []
    where = tmp_path / "packed"
    tokens, first, packed_from, modes = _start(model_file, where, lines)
    assert packed_from == ""
    assert any("packed matrices not kept" in line and "free" in line for line in lines)
    assert list(where.glob("*.bin")) == []
    assert "s" not in set("".join(modes))  # fresh memory, private
    monkeypatch.undo()
    plain_tokens, plain, _, _ = _start(model_file, None)
    assert (tokens, _same(first, plain)) == (plain_tokens, True)


def test_kept_packs_are_pruned_to_the_most_recently_used(tmp_path: Path) -> None:
    """Past KEPT_PACKS packs the least recently used go (their layouts' times: a map
    marks its layout used, never the pack, whose times are its identity), with their
    files; a temporary
    file a stopped start left goes once it is old, a fresh one stays (a start may be
    packing into it)."""
    stale = tmp_path / ".stale.tmp"
    fresh = tmp_path / ".fresh.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"x")
    os.utime(stale, (1, 1))
    caches = [
        _packcache.PackCache(str(tmp_path), f"{i:064x}", loaded_library())
        for i in range(_packcache.KEPT_PACKS + 1)
    ]
    for age, cache in enumerate(caches[:-1]):
        assert cache.keep(_kept(cache, age)) == ""
        os.utime(cache.meta, (1_000_000 + age, 1_000_000 + age))
    mapped = caches[0].open()  # used: now the newest
    assert mapped is not None
    assert (int(mapped.take(100)[0]), int(mapped.take(5000)[-1])) == (0, 1)
    mapped.finish()
    assert caches[-1].keep(_kept(caches[-1], 9)) == ""
    left = {p.stem for p in tmp_path.glob("*.bin")}
    assert left == {p.stem for p in tmp_path.glob("*.json")}
    assert left == {caches[0].key, caches[2].key, caches[3].key}
    assert (stale.exists(), fresh.exists()) == (False, True)


def _kept(cache: _packcache.PackCache, value: int) -> _packcache.FileArena:
    """An arena of two parts packed with `value` and `value + 1`."""
    arena = cache.create(0)
    assert isinstance(arena, _packcache.FileArena)
    arena.take(100).fill_(value)
    arena.take(5000).fill_(value + 1)
    return arena


def test_the_filesystem_is_the_longest_mount_above_the_path(tmp_path: Path) -> None:
    """mountinfo's mount points (octal escapes undone) matched as whole path parts, the
    longest above the path winning; a pack is neither kept nor mapped on a filesystem
    other machines share (NFS, SMB, FUSE, ...), and says so."""
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "23 22 0:22 / /srv/models\\040cache rw shared:7 - nfs4 host:/export rw\n"
        "24 22 0:23 / /srv/mod rw - tmpfs tmpfs rw\n"
        "25 23 0:24 / /srv/models\\040cache/local rw - xfs /dev/vdb rw\n"
    )
    assert _packcache.filesystem(Path("/srv/models cache/packed"), info) == "nfs4"
    assert _packcache.filesystem(Path("/srv/models cache/local/packed"), info) == "xfs"
    assert _packcache.filesystem(Path("/srv/modelsx"), info) == "ext4"
    assert _packcache.filesystem(Path("/srv/mod"), info) == "tmpfs"
    assert _packcache.filesystem(Path("/x"), tmp_path / "none") is None
    cache = _packcache.PackCache(str(tmp_path), "0" * 64, None)
    for kind in ("nfs4", "fuse.sshfs"):
        cache.filesystem = kind
        why = cache.create(0)
        assert isinstance(why, str)
        assert kind in why
        assert cache.open() is None
    assert list(tmp_path.glob("*.tmp")) == []


def test_mapped_matrices_are_not_memory_the_pool_may_take(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MemAvailable counts the page cache as memory to be had; a pack file's matrices
    are in it. --kv-capacity auto sizes the pool against MemAvailable less them, and
    says so (a cgroup's room already counts them, and is taken as it is)."""
    where = tmp_path / "packed"
    first = start_engine(model_file, EngineConfig(max_batch=2, packed_cache=str(where)))
    mapped = first.model.mapped_bytes
    stop_engine(first)
    if first.model.transformer.native is None:
        pytest.skip("the native kernels are not built here")
    assert mapped > 0
    available = KV_HEADROOM_BYTES + mapped + (64 << 20)
    for source, left in (("MemAvailable", available - mapped), ("cgroup memory limit", available)):
        monkeypatch.setattr(_startup, "available_memory", lambda _d, s=source: (available, s))
        config = EngineConfig(max_batch=2, packed_cache=str(where), kv_capacity="auto",
                              max_context=256)  # fmt: skip
        running = start_engine(model_file, config)
        try:
            assert running.model.packed_from != ""
            assert running.model.mapped_bytes == mapped
            sizing = running.engine.served().kv_sizing
            assert sizing is not None
            assert sizing.available_bytes == left
            assert ("mapped matrices" in sizing.memory_source) == (source == "MemAvailable")
        finally:
            stop_engine(running)
