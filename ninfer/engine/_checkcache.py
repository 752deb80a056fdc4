"""Start-up verdicts kept between starts: what the self-check and the batching checks
decided, under a key of everything they computed from.

The checks are deterministic: the same model bytes, run by the same engine code, kernels
library, torch build and configuration on the same kind of CPU, give the same bits and
so the same verdict. A start whose key matches a verdict kept by an earlier one adopts it
instead of computing it again (a 1.7B model's checks took 4.9 s of its 11 s to ready).
Only a verdict where every path passed and nothing was narrowed, refused or left
uninvariant is kept, so adopting one changes nothing about the model as loaded and hides
no warning; a start with any refusal checks again every time and says so. `--self-check
always` checks at every start (engine.md, "The self-check").

A verdict is one small JSON file, `<cache>/checks/<key>.json`, written whole (a temporary
file renamed over), read only if it parses to exactly this version's fields; anything
else is ignored and checked again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from ninfer.engine._contract import EngineConfig, PathCheck
from ninfer.engine._kept import keep_file, mark_used, os_error

__all__ = [
    "KEPT_VERDICTS",
    "VERDICT_VERSION",
    "Verdict",
    "engine_source_digest",
    "file_digest",
    "key_material",
    "now_utc",
    "processor",
    "read_verdict",
    "verdict_key",
    "write_verdict",
]

# Bumped when what a verdict holds, or what a key covers, changes.
VERDICT_VERSION = 2
# Verdicts kept, the most recently used (every change of the engine's code, a setting or
# the model makes a new key; the oldest go).
KEPT_VERDICTS = 64
# EngineConfig fields no check reads: the pool's size, the prefix cache, the template,
# the cache directories themselves.
_NOT_CHECKED = frozenset({"kv_capacity", "prefix_cache", "chat_template", "cache_dir",
                          "check_cache", "packed_cache"})  # fmt: skip
_ENGINE_DIR = Path(__file__).resolve().parent
_CPUINFO_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


@attrs.frozen
class Verdict:
    """What the start-up checks decided (the fields of `StartupPlan` they fix)."""

    self_check: tuple[PathCheck, ...]
    kv_dtype: str
    batch_sizes: tuple[int, ...]
    together_rows: int
    speculative: str
    native_top_p: bool
    native_top_k: bool
    native_sample: bool
    seconds: float  # what the checks took when they ran
    checked_at: str  # when, UTC, ISO 8601


def processor() -> dict[str, str]:
    """The CPU as the kernels see it: vendor, family, model, stepping and flags of the
    first processor (Linux's /proc/cpuinfo), else the platform's words."""
    out: dict[str, str] = {"machine": platform.machine(), "processor": platform.processor()}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block
            name, _, value = line.partition(":")
            if name.strip() in _CPUINFO_FIELDS:
                out[name.strip()] = value.strip()
    return out


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """A file's name and bytes, hashed (the kernels library a key covers)."""
    return _digest_files([path])


def engine_source_digest() -> str:
    """The engine package's Python source, hashed (any change of it is another key)."""
    return _digest_files(sorted(_ENGINE_DIR.glob("*.py")))


def key_material(config: EngineConfig, model_sha256: str, kernels: str,
                 library: Path | None) -> dict[str, Any]:  # fmt: skip
    """Everything a verdict was computed from, as plain values (hashed by verdict_key;
    kept in the file for people)."""
    settings = {
        f.name: getattr(config, f.name)
        for f in attrs.fields(EngineConfig)
        if f.name not in _NOT_CHECKED
    }
    return {
        "version": VERDICT_VERSION,
        "model_sha256": model_sha256,
        "kernels": kernels,
        "library": None if library is None else file_digest(library),
        "engine_source": engine_source_digest(),
        "torch": torch.__version__,
        "torch_config": hashlib.sha256(torch.__config__.show().encode()).hexdigest(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
        "python": sys.version,
        "cpu": processor(),
        "settings": settings,
    }


def verdict_key(material: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def read_verdict(directory: str, key: str) -> Verdict | None:
    """The verdict kept under `key`, or None (none kept, or not one this code wrote)."""
    try:
        raw = json.loads((Path(directory) / f"{key}.json").read_text(encoding="utf-8"))
        v = raw["verdict"]
        if raw.get("version") != VERDICT_VERSION or raw.get("key") != key:
            return None
        checks = tuple(
            PathCheck(c["path"], bool(c["ok"]), float(c["error"]), float(c["tolerance"]))
            for c in v["self_check"]
        )
        verdict = Verdict(
            self_check=checks,
            kv_dtype=str(v["kv_dtype"]),
            batch_sizes=tuple(int(n) for n in v["batch_sizes"]),
            together_rows=int(v["together_rows"]),
            speculative=str(v["speculative"]),
            native_top_p=bool(v["native_top_p"]),
            native_top_k=bool(v["native_top_k"]),
            native_sample=bool(v["native_sample"]),
            seconds=float(v["seconds"]),
            checked_at=str(v["checked_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not checks or not all(c.ok for c in checks) or not verdict.batch_sizes:
        return None  # never written so: not to be trusted
    mark_used(Path(directory) / f"{key}.json")
    return verdict


def write_verdict(directory: str, key: str, material: dict[str, Any], verdict: Verdict) -> str:
    """Keep `verdict` under `key` (a temporary file renamed over: a reader sees the whole
    file or none). Returns "" or why it could not be kept (the server serves either way)."""
    body = {
        "version": VERDICT_VERSION,
        "key": key,
        "material": material,
        "verdict": {
            **attrs.asdict(verdict, recurse=False),
            "self_check": [c.as_dict() for c in verdict.self_check],
        },
    }
    try:
        keep_file(
            Path(directory) / f"{key}.json",
            json.dumps(body, indent=1, sort_keys=True).encode(),
            keep=KEPT_VERDICTS,
        )
    except OSError as e:
        return os_error(e)
    return ""


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
