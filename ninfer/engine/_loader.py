"""Loading a GGUF model: identity, tokenizer, torch weights."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch

from ninfer.engine._contract import PRESET_FIELDS, ModelIdentity, Pooling, SamplingPreset
from ninfer.engine._gguf import GGUFFile, file_sha256, open_gguf
from ninfer.engine._invariance import prime_vector_math
from ninfer.engine._kernels import loaded_library
from ninfer.engine._model import Transformer, load_transformer
from ninfer.engine._native import PackArena, native_unsupported
from ninfer.engine._packcache import FileArena, MappedArena, PackCache, StalePack
from ninfer.engine._tokenizer import TextTokenizer, tokenizer_from_metadata

__all__ = ["LoadedModel", "load_model", "trim_heap"]


@attrs.frozen
class LoadedModel:
    identity: ModelIdentity
    tokenizer: TextTokenizer
    transformer: Transformer
    load_seconds: float
    sampling_preset: SamplingPreset = attrs.field(factory=SamplingPreset)
    # The opened file (memory-mapped), for the engine's self-check and the exact paths
    # it may fall back to; dropped once the engine has started.
    source: GGUFFile | None = attrs.field(default=None, eq=False, repr=False)
    # Which kernels run it ("native <isa>, <n> threads", or "torch" and why)
    kernels: str = "torch"
    # The kept pack its native matrices were mapped from (`_packcache`); "": packed
    # from the file by this start (or not native)
    packed_from: str = ""
    # Bytes of its matrices in a pack file's map (page cache, not the process's own)
    mapped_bytes: int = 0


# GGUF's recommended-sampling keys (llama.cpp reads the same) and the fields they set.
# `general.sampling.penalty_repeat` is a multiplicative repetition penalty, not
# OpenAI's additive presence penalty: not used.
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
}


# llama.cpp's enum llama_pooling_type, as `<arch>.pooling_type` stores it (4, rank, is a
# reranker's: not served here).
_GGUF_POOLING: dict[int, Pooling] = {0: "none", 1: "mean", 2: "cls", 3: "last"}


def gguf_pooling(
    metadata: Mapping[str, object], progress: Callable[[str], None] = lambda _m: None
) -> Pooling | None:
    """The file's pooling for embeddings (an embedding model's GGUF names one), or None."""
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    if value is None:
        return None
    pooling = _GGUF_POOLING.get(value) if type(value) is int else None
    if pooling is None:
        progress(f"the file's pooling_type {value!r} is not one served here: not used")
    return pooling


def sampling_preset(
    metadata: Mapping[str, object], progress: Callable[[str], None] = lambda _m: None
) -> SamplingPreset:
    """The file's recommended sampling defaults. A value of the wrong type or outside
    what a request may send is left out, and said."""
    found: dict[str, Any] = {}  # field -> value, checked above
    for key, field in _GGUF_SAMPLING.items():
        value = metadata.get(key)
        if value is None:
            continue
        low, high = PRESET_FIELDS[field]
        wanted = (int,) if field == "top_k" else (int, float)
        if (
            isinstance(value, bool)
            or not isinstance(value, wanted)
            or not low <= value <= high  # NaN too
        ):
            progress(f"{key} = {value!r} is not used: not a number in {low}..{high}")
            continue
        found[field] = value if field == "top_k" else float(value)
    if not found:
        return SamplingPreset()
    return attrs.evolve(SamplingPreset(source="gguf general.sampling"), **found)


def _model_id(metadata: Mapping[str, object], path: str) -> str:
    """A URL-safe id from `general.name` (else the file name): lower case, dashes."""
    raw = metadata.get("general.name")
    if not isinstance(raw, str) or not raw.strip():
        raw = os.path.splitext(os.path.basename(path))[0]
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", raw.strip()).strip("-").lower()
    return slug or "model"


def trim_heap() -> None:
    """Return freed staging memory to the OS (glibc only; a no-op elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)


def _arena(
    packs: PackCache | None,
    expected: int,
    progress: Callable[[str], None],
    *,
    mapped: bool = True,
) -> PackArena:
    """Where the native matrices go: a kept pack's map (`mapped`), else a new pack file,
    else fresh memory."""
    if packs is None:
        return PackArena()
    kept = packs.open() if mapped else None
    if kept is not None:
        return kept
    arena = packs.create(expected)
    if isinstance(arena, str):
        progress(f"packed matrices not kept: {arena}")
        return PackArena()
    return arena


def load_model(
    path: str,
    *,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    weights: str = "int4",
    native: bool = False,
    chat_template: str | None = None,
    cache_dir: str | None = None,
    packed_cache: str | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> LoadedModel:
    """Read, verify and load a GGUF model; `max_positions` sizes the rotary table;
    `chat_template` (Jinja text) replaces the file's own. `native`: for ninfer's native
    kernels (loaded and configured by the caller), where the model allows them.
    `cache_dir`: where the file's sha256 (digests/, `file_sha256`) and a SentencePiece
    vocabulary's merge order (tokenizers/) are kept between starts, if anywhere;
    `packed_cache`: where the native kernels' packed matrices are (`_packcache`)."""
    prime_vector_math()  # before any of torch's math runs on two threads
    t0 = time.perf_counter()
    progress(f"reading {path}")
    gguf = open_gguf(path)
    # The tokenizer (Python: Gemma 3's 514,847 merges ranked, the control tokens compiled
    # into one pattern) is built beside the file's sha256 (hashlib, GIL released), each
    # on a core; the layers' packing then has both cores (the three at once took longer:
    # the 1B's 3.8 s against 2.9 s, docs/benchmarks.md).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ninfer-tokenizer") as beside:
        kept = (lambda part: str(Path(cache_dir) / part)) if cache_dir else (lambda _p: None)
        tokenizer_job = beside.submit(
            tokenizer_from_metadata,
            gguf.metadata,
            chat_template=chat_template,
            merges_kept=kept("tokenizers"),
        )
        sha = file_sha256(path, kept("digests"))
        tokenizer = tokenizer_job.result()
    progress(
        f"parsed {len(gguf.tensors)} tensors, vocabulary {tokenizer.vocab_size} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    model_id = _model_id(gguf.metadata, path)
    kernels = "native" if native else "torch"
    unsupported = native_unsupported(gguf.args, dtype, device) if native else None
    if unsupported is not None:
        kernels = f"torch (the native kernels cannot run this model: {unsupported})"
        progress(f"kernels: {kernels}")
    native = native and unsupported is None
    packs = PackCache(packed_cache, sha, loaded_library()) if native and packed_cache else None
    size = os.path.getsize(path)  # a pack is about the file's size
    arena = _arena(packs, size, progress)

    def load(arena: PackArena) -> Transformer:
        return load_transformer(
            gguf, dtype=dtype, device=device, max_positions=max_positions, weights=weights,
            native=native, arena=arena,
        )  # fmt: skip

    try:
        transformer = load(arena)
        if isinstance(arena, MappedArena):
            arena.finish()
    except StalePack as e:
        progress(f"the kept packed matrices do not fit ({e}): packing them again")
        arena = _arena(packs, size, progress, mapped=False)
        transformer = load(arena)
    except BaseException:
        if isinstance(arena, FileArena):
            arena.discard()
        raise
    packed_from = str(arena.path) if isinstance(arena, MappedArena) else ""
    if packed_from:
        progress(f"packed matrices mapped from {packed_from}, kept by an earlier start")
    elif packs is not None and isinstance(arena, FileArena):
        why = packs.keep(arena)
        progress(f"packed matrices not kept: {why}" if why else
                 f"packed matrices kept for the next start: {packs.bin}")  # fmt: skip
    trim_heap()
    elapsed = time.perf_counter() - t0
    a = transformer.args
    held = "the file's blocks, native kernels" if transformer.native else f"{weights} weights"
    progress(f"loaded {a.n_layers} layers as {dtype} ({held}) on {device} in {elapsed:.1f}s")
    identity = ModelIdentity(
        model_id=model_id,
        architecture=a.architecture,
        sha256=sha,
        context_length=a.context_length,
        vocab_size=a.vocab_size,
        path=path,
        pooling=gguf_pooling(gguf.metadata, progress),
    )
    return LoadedModel(
        identity=identity,
        tokenizer=tokenizer,
        transformer=transformer,
        load_seconds=elapsed,
        sampling_preset=sampling_preset(gguf.metadata, progress),
        source=gguf,
        kernels=kernels,
        packed_from=packed_from,
        mapped_bytes=arena.mapped_bytes(),
    )
