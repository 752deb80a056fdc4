"""The engine checks every fast path it chose before it serves: a wrong kernel, planted
here, is refused (the next exact path runs instead, and the console, `server_start`
and `/ready` say so); a model with no exact path left does not become ready. The native
kernels' paths first, then torch's (`TORCH`: the engine held to them)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from conftest import HANG_GUARD_S, CollectingSink, start_engine, stop_engine
from hangguard import wait_until
from tinymodel import write_tiny_gguf

from ninfer.engine import (
    EngineConfig,
    GenerationRequest,
    PathCheck,
    SamplingParams,
    _checkcache,
    _kvpool,
    _model,
    _sampling,
    _selfcheck,
)
from ninfer.engine import _native as native
from ninfer.engine._loader import load_model
from ninfer.engine._runtime import create_engine
from ninfer.engine._selfcheck import SelfCheck, SelfCheckFailed, probe_tokens
from ninfer.engine._startup import MEASURED_PANELS

# The torch path's checks: an engine held to torch's kernels.
TORCH = {"kernels": "torch"}
NATIVE_PATHS = {
    "native_dequant", "native_matmul", "native_head", "native_attention", "native_layers",
    "native_final_norm",
}  # fmt: skip


@pytest.fixture(scope="module")
def packed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer matrix in Q4 (the int4 kernel's), as SmolLM2's file is."""
    return write_tiny_gguf(tmp_path_factory.mktemp("packed") / "packed.gguf", packed_layers=True)


def _checks(path: Path, config: EngineConfig, plant: Callable[[], None] = lambda: None) -> Any:
    """The engine's self-check results and its greedy tokens for three prompts."""
    plant()
    running = start_engine(path, config)
    try:
        served = running.engine.served()
        handles = [
            running.engine.submit(GenerationRequest(f"r{i}", tuple(range(3 + i, 20 + 3 * i)), 8))
            for i in range(3)
        ]
        running.sink.wait_done(*handles)
        return served, [running.sink.tokens[h.id] for h in handles]
    finally:
        stop_engine(running)


def _by_path(checks: tuple[PathCheck, ...]) -> dict[str, PathCheck]:
    return {c.path: c for c in checks}


@pytest.mark.parametrize("packed", [True, False])
def test_every_path_passes_on_a_model_computed_right(
    packed: bool, packed_gguf: Path, tiny_gguf: Path
) -> None:
    """On the tiny models (all-int4, and int4 with float32 matrices) every path passes,
    each within its stated tolerance, and the engine reports each."""
    served, _ = _checks(packed_gguf if packed else tiny_gguf, EngineConfig(max_batch=4, **TORCH))
    checks = _by_path(served.self_check)
    expected = {"dequantizer", "embedding", "int4_kernel", "head", "attention"}
    expected |= {"prefill_together", "decode_batch", "kv_float16"}
    expected |= set() if packed else {"dense_float32"}
    assert set(checks) == expected
    assert all(c.ok and c.error <= c.tolerance for c in checks.values())
    assert checks["int4_kernel"].error > 0  # bfloat16 rounding: measured, not assumed
    assert checks["head"].tolerance == 1e-5


@pytest.mark.parametrize(
    ("packed", "kv_dtype"), [(True, "auto"), (False, "auto"), (True, "int8"), (True, "float32")]
)
def test_every_native_path_passes_on_a_model_computed_right(
    packed: bool, kv_dtype: str, packed_gguf: Path, tiny_gguf: Path
) -> None:
    """On the native kernels (the default where they are built) every native path passes,
    each within its stated tolerance and each error measured (float32 rounds: not 0),
    then the whole passes; the engine says it runs on them. With an int8 KV pool, its
    native writer and attention are checked too, and so with the float16 pool auto
    chooses (none with a float32 pool); the sampler's native top-p always."""
    config = EngineConfig(max_batch=4, kv_dtype=kv_dtype)
    served, _ = _checks(packed_gguf if packed else tiny_gguf, config)
    assert served.kernels.startswith("native ")
    checks = _by_path(served.self_check)
    pool_check = {"int8": {"native_kv_int8"}, "auto": {"native_kv_float16"}}.get(kv_dtype, set())
    assert set(checks) == NATIVE_PATHS | {
        "dequantizer", "embedding", "native_top_p", "native_top_k", "native_sample",
        "prefill_together", "decode_batch",
    } | pool_check  # fmt: skip
    assert all(c.ok and c.error <= c.tolerance for c in checks.values())
    assert checks["native_dequant"].error == 0.0
    assert 0 < checks["native_matmul"].error < 1e-5
    assert checks["native_layers"].error > 0
    assert 0 < checks["native_final_norm"].error < 1e-5
    if kv_dtype == "int8":
        assert 0 < checks["native_kv_int8"].error < 1e-5  # the codes exact, the sums rounded
    if kv_dtype == "auto":
        assert 0 < checks["native_kv_float16"].error < 1e-5  # the halves exact, sums rounded
    assert served.kv_sizing is not None
    assert served.kv_sizing.kv_dtype == {"auto": "float16"}.get(kv_dtype, kv_dtype)
    assert served.batch_sizes == (1, 2, 3, 4)  # every row count computes a row alike


def test_the_checked_layers_are_every_form_a_layer_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of 6 layers whose fourth stores its ffn_down as Q8_0 (the only matrix of that
    type), the check runs the first, the fourth and the last; a native matmul wrong only
    on Q8_0 matrices (planted) is refused there, and the model goes to torch's kernels."""
    path = write_tiny_gguf(tmp_path / "odd.gguf", n_layers=6, packed_layers=True, odd_layer=3)
    m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=512)
    assert m.source is not None
    with torch.inference_mode():
        check = SelfCheck(m.transformer, m.source, probe_tokens(m.tokenizer, m.identity.vocab_size))
        assert check.checked_layers() == [0, 3, 5]
    real = native.Packed.__call__

    def wrong_on_q8(self: native.Packed, x: torch.Tensor) -> torch.Tensor:
        out = real(self, x)
        return out * 1.001 if "Q8_0" in self.kinds else out

    served, _ = _checks(
        path,
        EngineConfig(max_batch=4),
        lambda: monkeypatch.setattr(native.Packed, "__call__", wrong_on_q8),
    )
    checks = _by_path(served.self_check)
    assert not checks["native_matmul"].ok
    assert served.kernels == "torch (the self-check refused the native kernels)"


def test_a_wrong_row_between_the_sampled_ones_is_refused_by_the_whole_layer_check(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The matrix check compares sampled output rows with float64 (here 4 of each of
    gate and up's 128: 0, 1, 126, 127); a feed-forward matrix packed wrong on rows
    32-47 alone (one panel's bytes changed, planted) passes it, and the whole-layer
    check, which computes every output, refuses the native kernels."""
    monkeypatch.setattr(_selfcheck, "MATRIX_SAMPLE", 4)
    monkeypatch.setattr(_selfcheck, "MATRIX_EDGE", 1)
    assert _selfcheck._spread(128, 4, 1).tolist() == [0, 1, 126, 127]
    real = _model.pack_tensors
    changed: list[list[int]] = []

    def one_panel_wrong(gguf: Any, names: Any, arena: Any = None) -> native.Packed:
        m = real(gguf, names, arena)
        if names[0] == "blk.1.ffn_gate.weight":
            ids = torch.arange(m.out_features)
            before = m.rows(ids)
            panel = m.data.numel() // (m.out_features // 16)
            m.data[2 * panel + panel // 2 : 3 * panel] ^= 0x11
            changed.append(ids[(m.rows(ids) != before).any(dim=-1)].tolist())
        return m

    served, _ = _checks(
        packed_gguf,
        EngineConfig(max_batch=4),
        lambda: monkeypatch.setattr(_model, "pack_tensors", one_panel_wrong),
    )
    assert changed
    assert all(rows and set(rows) <= set(range(32, 48)) for rows in changed)
    checks = _by_path(served.self_check)
    assert checks["native_matmul"].ok  # the planted rows are not among the sampled ones
    assert not checks["native_layers"].ok
    assert served.kernels == "torch (the self-check refused the native kernels)"


def test_the_torch_int8_pool_is_checked_where_torch_serves(packed_gguf: Path) -> None:
    """On torch's kernels with an int8 KV pool, its write and read-back are checked
    (`kv_int8`); no native path is, top-p included."""
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4, kv_dtype="int8", **TORCH))
    checks = _by_path(served.self_check)
    assert checks["kv_int8"].ok
    assert 0 < checks["kv_int8"].error < 1e-5
    assert not set(checks) & (
        NATIVE_PATHS | {"native_top_p", "native_top_k", "native_sample", "native_kv_int8"}
    )


@pytest.mark.parametrize(
    ("path", "plant"),
    [
        ("native_matmul", lambda mp: _scale_method(mp, native.Packed, "__call__", 1.001)),
        ("native_attention", lambda mp: _scale_function(mp, native, "attention", 1.001)),
        ("native_layers", lambda mp: _offset_layers(mp, 1e-3)),
        ("native_final_norm", lambda mp: _scale_function(mp, native, "rmsnorm", 1.001)),
        ("native_kv_int8", lambda mp: _scale_int8_scales(mp, 1.01)),
        ("native_kv_int8", lambda mp: _scale_int8_attention(mp, 1.001)),
    ],
)
def test_a_wrong_native_path_sends_the_model_to_torchs_kernels(
    path: str, plant: Callable[[pytest.MonkeyPatch], None], packed_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A native matmul 0.1% off, an attention 0.1% off, layers that shift the residual
    stream, a final norm 0.1% off, an int8 pool written with scales 1% off or read by an
    attention 0.1% off (planted) are refused: the whole model runs on torch's kernels
    instead, their paths checked in turn, the engine says so, and the answers are those
    of an engine held to torch's kernels."""
    kv_dtype = "int8" if path == "native_kv_int8" else "auto"
    config = EngineConfig(max_batch=4, kv_dtype=kv_dtype)
    served, tokens = _checks(packed_gguf, config, lambda: plant(monkeypatch))
    checks = _by_path(served.self_check)
    assert not checks[path].ok
    assert checks[path].instead == "torch kernels (int4)"
    assert checks["int4_kernel"].ok
    if kv_dtype == "int8":
        assert checks["kv_int8"].ok  # torch's int8 pool, checked in its turn
    assert served.kernels == "torch (the self-check refused the native kernels)"
    monkeypatch.undo()
    _, torch_tokens = _checks(packed_gguf, EngineConfig(max_batch=4, kv_dtype=kv_dtype, **TORCH))
    assert tokens == torch_tokens


def _scale_int8_scales(mp: pytest.MonkeyPatch, factor: float) -> None:
    """The native layers writing an int8 pool's scales `factor` off."""
    real = native.NativeLayers.forward

    def off(self: native.NativeLayers, *a: Any, **k: Any) -> torch.Tensor:
        out = real(self, *a, **k)
        kv = a[8] if len(a) > 8 else k["kv"]
        if kv.k_scale is not None:
            kv.k_scale.mul_(factor)
        return out

    mp.setattr(native.NativeLayers, "forward", off)


def _scale_int8_attention(mp: pytest.MonkeyPatch, factor: float) -> None:
    """The native attention `factor` off over an int8 pool only."""
    real = native.attention

    def off(q: torch.Tensor, kv: Any, *a: Any, **k: Any) -> torch.Tensor:
        out = real(q, kv, *a, **k)
        return out * factor if kv.k_scale is not None else out

    mp.setattr(native, "attention", off)


def _sampled(path: Path, req: GenerationRequest) -> tuple[dict[str, PathCheck], list[int]]:
    """An engine's self-check results and its tokens for `req`, alone."""
    running = start_engine(path, EngineConfig(max_batch=4))
    try:
        handle = running.engine.submit(req)
        running.sink.wait_done(handle)
        return _by_path(running.engine.served().self_check), running.sink.tokens[handle.id]
    finally:
        stop_engine(running)


# A native sampler selection, or a wrong copy of it made from the real one.
Selection = Callable[..., torch.Tensor]


def _short_top_p(real: Selection) -> Selection:
    """A native top-p that drops the last token the full sort keeps."""

    def short(probs: torch.Tensor, p: float) -> torch.Tensor:
        kept = real(probs, p)
        return kept[:-1] if len(kept) > 1 else kept

    return short


def _sample_the_runner_up(real: Callable[..., list[int]]) -> Callable[..., list[int]]:
    """A batched sampler that picks the next token up in id order from the right one."""

    def next_up(logits: torch.Tensor, rows: list[int], samplers: list[Any]) -> list[int]:
        return [min(t + 1, logits.shape[1] - 1) for t in real(logits, rows, samplers)]

    return next_up


def _top_k_without_ties(real: Selection) -> Selection:
    """A native top-k that leaves out the tokens tied with the k-th."""

    def without_ties(logits: torch.Tensor, k: int) -> torch.Tensor:
        return torch.sort(torch.topk(logits, k).indices).values if k > 1 else real(logits, k)

    return without_ties


@pytest.mark.parametrize(
    ("path", "native", "wrong", "instead", "sampling"),
    [
        ("native_top_p", "native_top_p_kept", _short_top_p, "the full sort",
         SamplingParams(temperature=1.5, top_p=0.9, seed=11)),
        ("native_top_k", "native_top_k_ids", _top_k_without_ties, "torch's top-k",
         SamplingParams(temperature=1.5, top_k=5, seed=3)),
        ("native_sample", "native_sample", _sample_the_runner_up, "each row's torch calls",
         SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=5)),
    ],
)  # fmt: skip
def test_a_wrong_native_sampler_selection_is_refused_for_torchs(
    path: str, native: str, wrong: Callable[[Selection], Selection],
    instead: str, sampling: SamplingParams, packed_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A native top-p that drops the last token the full sort keeps, a native top-k
    that leaves out the tokens tied with the k-th, or a batched sampler that picks the
    next token up in id order (planted), is refused: the sampler takes torch's way
    instead (the full sort; torch.topk and the ties; each row's own torch calls), so a
    seeded request gets the tokens it gets where the native one is right; the kernels
    and the other selection still serve."""
    req = GenerationRequest(path, tuple(range(4, 24)), 16, sampling=sampling)
    right_checks, right = _sampled(packed_gguf, req)
    assert right_checks[path].ok
    monkeypatch.setattr(_sampling, native, wrong(getattr(_sampling, native)))
    checks, tokens = _sampled(packed_gguf, req)
    assert not checks[path].ok
    assert checks[path].instead == instead
    assert all(checks[p].ok for p in NATIVE_PATHS)  # the kernels themselves still serve
    other = {"native_top_p": "native_top_k", "native_top_k": "native_top_p",
             "native_sample": "native_top_k"}[path]  # fmt: skip
    assert checks[other].ok
    assert tokens == right


def test_a_wrong_torch_int8_pool_leaves_no_exact_path(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On torch's kernels, an int8 pool that quantizes with scales 1% off (planted) has
    no exact path to fall back to: the engine refuses to serve, naming it."""
    real = _kvpool._quantize

    def off(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = real(rows)
        return q, scale * 1.01

    monkeypatch.setattr(_kvpool, "_quantize", off)
    exc = _failed_start(packed_gguf, EngineConfig(max_batch=2, kv_dtype="int8", **TORCH))
    assert "int8 KV pool" in str(exc)


def _halves_one_step_up(mp: pytest.MonkeyPatch) -> None:
    """The native layers writing a float16 pool's keys each one half's step off."""
    real = native.NativeLayers.forward

    def off(self: native.NativeLayers, *a: Any, **k: Any) -> torch.Tensor:
        out = real(self, *a, **k)
        kv = a[8] if len(a) > 8 else k["kv"]
        if kv.k.dtype == torch.float16:
            kv.k.view(torch.int16).add_(1)
        return out

    mp.setattr(native.NativeLayers, "forward", off)


def _torch_halves_off(mp: pytest.MonkeyPatch) -> None:
    """torch's float16 pool read back 0.1% off."""
    real = _kvpool.KVPages.gather

    def off(self: _kvpool.KVPages, *a: Any) -> tuple[torch.Tensor, ...]:
        k, v = real(self, *a)
        return (k * 1.001, v) if self.k.dtype == torch.float16 else (k, v)

    mp.setattr(_kvpool.KVPages, "gather", off)


@pytest.mark.parametrize(
    ("kernels", "plant"),
    [("auto", _halves_one_step_up), ("auto", lambda mp: _scale_half_attention(mp, 1.001)),
     ("torch", _torch_halves_off)],
)  # fmt: skip
def test_a_wrong_float16_pool_leaves_auto_on_a_float32_pool(
    kernels: str, plant: Callable[[pytest.MonkeyPatch], None], packed_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A float16 pool written one half's step off, or read by an attention 0.1% off, on
    the native kernels or torch's (planted), is refused: under --kv-dtype auto the pool
    stores float32 instead (sized again, the kernels kept), the engine says so, and the
    answers are those of --kv-dtype float32; asked for by name (--kv-dtype float16), the
    engine does not become ready."""
    served, tokens = _checks(
        packed_gguf, EngineConfig(max_batch=4, kernels=kernels), lambda: plant(monkeypatch)
    )
    checks = _by_path(served.self_check)
    path = "kv_float16" if kernels == "torch" else "native_kv_float16"
    assert not checks[path].ok
    assert checks[path].instead == "float32 KV cache"
    assert served.kernels.startswith("native " if kernels == "auto" else "torch")
    assert all(c.ok for c in checks.values() if c.path != path)
    assert served.kv_sizing is not None
    assert served.kv_sizing.kv_dtype == "float32"
    exc = _failed_start(packed_gguf, EngineConfig(max_batch=2, kernels=kernels, kv_dtype="float16"))
    assert "float16 KV pool" in str(exc)
    monkeypatch.undo()
    _, plain = _checks(packed_gguf, EngineConfig(max_batch=4, kernels=kernels, kv_dtype="float32"))
    assert tokens == plain


def _scale_half_attention(mp: pytest.MonkeyPatch, factor: float) -> None:
    """The native attention `factor` off over a float16 pool only."""
    real = native.attention

    def off(q: torch.Tensor, kv: Any, *a: Any, **k: Any) -> torch.Tensor:
        out = real(q, kv, *a, **k)
        return out * factor if kv.k.dtype == torch.float16 else out

    mp.setattr(native, "attention", off)


def _scale_method(mp: pytest.MonkeyPatch, cls: Any, name: str, factor: float) -> None:
    real = getattr(cls, name)
    mp.setattr(cls, name, lambda self, *a, **k: real(self, *a, **k) * factor)


def _scale_function(mp: pytest.MonkeyPatch, module: Any, name: str, factor: float) -> None:
    real = getattr(module, name)
    mp.setattr(module, name, lambda *a, **k: real(*a, **k) * factor)


def _offset_layers(mp: pytest.MonkeyPatch, offset: float) -> None:
    real = native.NativeLayers.forward

    def shifted(self: native.NativeLayers, x: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        out = real(self, x, *a, **k)
        return out.add_(offset * out.abs().mean())

    mp.setattr(native.NativeLayers, "forward", shifted)


def test_a_wrong_int4_kernel_is_refused_and_the_file_values_run_instead(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An int4 kernel 3% off is refused: the packed matrices run as their float32
    values, so the answers are those of `--weights dense` exactly."""
    real = _model.Int4.native

    def off(self: _model.Int4, x: torch.Tensor) -> torch.Tensor:
        return real(self, x) * 1.03

    served, tokens = _checks(
        packed_gguf,
        EngineConfig(max_batch=4, **TORCH),
        lambda: monkeypatch.setattr(_model.Int4, "native", off),
    )
    checks = _by_path(served.self_check)
    assert not checks["int4_kernel"].ok
    assert checks["int4_kernel"].error > checks["int4_kernel"].tolerance
    assert checks["int4_kernel"].instead == "dense_float32"
    assert checks["dense_float32"].ok
    monkeypatch.undo()
    _, dense = _checks(packed_gguf, EngineConfig(max_batch=4, weights="dense", **TORCH))
    assert tokens == dense


def test_torchs_int4_kernel_is_checked_on_every_output(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch's kernels have no whole-layer check behind them, so their matrices are
    compared on every output, not on the native check's sample: an int4 kernel 30% off
    on outputs 32-47 of the gate alone (planted; the sampled rows would be 0, 1, 126 and
    127 of gate and of up here) is refused."""
    monkeypatch.setattr(_selfcheck, "MATRIX_SAMPLE", 4)
    monkeypatch.setattr(_selfcheck, "MATRIX_EDGE", 1)
    real = _model.Int4.native

    def one_panel_off(self: _model.Int4, x: torch.Tensor) -> torch.Tensor:
        out = real(self, x)
        if self.out_features == 256:  # gate and up, 128 outputs each
            out[..., 32:48] *= 1.3
        return out

    served, _ = _checks(
        packed_gguf,
        EngineConfig(max_batch=4, **TORCH),
        lambda: monkeypatch.setattr(_model.Int4, "native", one_panel_off),
    )
    checks = _by_path(served.self_check)
    assert not checks["int4_kernel"].ok
    assert checks["int4_kernel"].instead == "dense_float32"


def test_a_wrong_embedding_decoder_is_refused_for_the_reference_one(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token rows decoded off by one part in 10^4 are refused: the `gguf` package's
    decoder runs instead (for the tied head's table too), and the answers are those
    of an engine decoding right."""
    real = _model.decode_blocks

    def off(kind: str, raw: torch.Tensor, name: str = "?") -> torch.Tensor:
        return real(kind, raw, name) * 1.0001

    _, right = _checks(tiny_gguf, EngineConfig(max_batch=4, **TORCH))
    served, tokens = _checks(
        tiny_gguf,
        EngineConfig(max_batch=4, **TORCH),
        lambda: monkeypatch.setattr(_model, "decode_blocks", off),
    )
    checks = _by_path(served.self_check)
    assert not checks["embedding"].ok
    assert checks["embedding"].instead == "numpy decoding"
    assert tokens == right


def test_a_wrong_onednn_matmul_is_refused_for_mkl(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 matmul 0.1% off in oneDNN is refused for the layers and the head
    alike: MKL runs them, checked in its turn."""
    real = _model._onednn_linear
    monkeypatch.setattr(_model, "_onednn_linear", lambda x, w: real(x, w) * 1.001)
    served, _ = _checks(tiny_gguf, EngineConfig(max_batch=4, **TORCH))
    checks = _by_path(served.self_check)
    assert (checks["dense_float32"].ok, checks["dense_float32"].instead) == (False, "mkl")
    assert (checks["head"].ok, checks["head"].instead) == (False, "mkl")
    assert checks["dense_float32_mkl"].ok
    assert checks["head_mkl"].ok


def test_prompts_that_change_each_other_are_not_prefilled_together(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward pass in which groups of rows change each other's numbers (planted) is
    refused for prefilling together: one prompt a pass."""
    real = _model.Transformer.hidden_many

    def leaky(self: _model.Transformer, groups: Any, kv: _model.KVPages) -> list[torch.Tensor]:
        out = real(self, groups, kv)
        return [x + 1e-6 * (len(groups) - 1) for x in out]

    monkeypatch.setattr(_model.Transformer, "hidden_many", leaky)
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4))
    checks = _by_path(served.self_check)
    assert not checks["prefill_together"].ok
    assert served.prefill_together_rows == 0


def test_a_prompt_that_changes_a_decode_row_beside_it_is_not_prefilled_together(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass in which a decode row and a prompt change each other's numbers (planted:
    only where one of the groups is a decode step's) is refused for prefilling together,
    and so for a prompt in a decode step's pass: one prompt a pass."""
    real = _model.Transformer.hidden_many

    def leaky(self: _model.Transformer, groups: Any, kv: _model.KVPages) -> list[torch.Tensor]:
        out = real(self, groups, kv)
        beside = len(groups) > 1 and any(int(g[0].shape[1]) == 1 for g in groups)
        return [x + 1e-6 if beside else x for x in out]

    monkeypatch.setattr(_model.Transformer, "hidden_many", leaky)
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4))
    checks = _by_path(served.self_check)
    assert not checks["prefill_together"].ok
    assert served.prefill_together_rows == 0


def test_a_native_product_whose_rows_depend_on_their_count_is_not_prefilled_together(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up measurement of products of up to 1,024 rows runs on the first
    panels of each native matrix kind (the feed-forward's 256 outputs measured on 128,
    never whole), and a native matmul that computes its rows differently in a product
    of more than 64 rows (planted) is found there: prompts are prefilled one a pass."""
    real = native.Packed.__call__
    widths: list[int] = []
    wrong = False

    def by_count(self: native.Packed, x: torch.Tensor) -> torch.Tensor:
        out = real(self, x)
        if x.dim() == 2 and x.shape[0] > 64:
            widths.append(self.out_features)
            return out * 1.0001 if wrong else out
        return out

    monkeypatch.setattr(native.Packed, "__call__", by_count)
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4))
    assert served.prefill_together_rows > 0
    # wo and ffn_down (64 outputs) and wqkv (128) whole; gate_up on its first 8 panels
    assert sorted(set(widths)) == [64, 16 * MEASURED_PANELS]
    wrong = True
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4))
    assert served.prefill_together_rows == 0


def test_a_native_product_whose_rows_depend_on_the_batch_size_is_padded_past_it(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up measurement of which decode batch sizes compute a row as the
    largest batch does runs on the first panels of each native matrix, the head too
    (never whole: the tiny model's head has more than 8 panels of outputs), and a native
    matmul that computes its rows differently in a product of 3 rows (planted) is found
    there: a step of 3 rows is padded to 4, and prompts are prefilled one a pass."""
    real = native.Packed.__call__
    widths: set[int] = set()
    wrong = False

    def by_count(self: native.Packed, x: torch.Tensor) -> torch.Tensor:
        out = real(self, x)
        if x.dim() == 2 and x.shape[0] == 3:
            widths.add(self.out_features)
            return out * 1.0001 if wrong else out
        return out

    monkeypatch.setattr(native.Packed, "__call__", by_count)
    running = start_engine(packed_gguf, EngineConfig(max_batch=4))  # start-up alone
    try:
        assert running.engine.served().batch_sizes == (1, 2, 3, 4)
    finally:
        stop_engine(running)
    assert widths == {64, 128}  # wo and ffn_down, wqkv whole; gate_up and the head: 8 panels
    wrong = True
    served, _ = _checks(packed_gguf, EngineConfig(max_batch=4))
    assert served.batch_sizes == (1, 2, 4)
    assert served.prefill_together_rows == 0


def test_decode_rows_that_depend_on_the_batch_are_padded_to_the_largest(
    packed_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits that depend on the number of rows of a decode step (planted) are refused:
    every step is padded to the largest batch, where a row is computed alike, and the
    engine says so; a seeded request then gets the same tokens alone and in a batch."""
    real = _model.Transformer.forward

    def batch_dependent(self: _model.Transformer, tokens: torch.Tensor, *a: Any, **k: Any) -> Any:
        return real(self, tokens, *a, **k) + 1e-4 * tokens.shape[0]

    monkeypatch.setattr(_model.Transformer, "forward", batch_dependent)
    running = start_engine(packed_gguf, EngineConfig(max_batch=4))
    try:
        checks = _by_path(running.engine.served().self_check)
        assert not checks["decode_batch"].ok
        assert checks["decode_batch_padded"].ok
        assert running.engine.served().batch_sizes == (4,)
        sampling = SamplingParams(temperature=0.9, seed=7)
        req = GenerationRequest("s", tuple(range(5, 30)), 12, sampling=sampling)
        alone = running.engine.submit(req)
        running.sink.wait_done(alone)
        others = [
            running.engine.submit(GenerationRequest(f"o{i}", tuple(range(9, 40 + i)), 20))
            for i in range(3)
        ]
        batched = running.engine.submit(req)
        running.sink.wait_done(batched, *others)
        assert running.sink.tokens[alone.id] == running.sink.tokens[batched.id]
    finally:
        stop_engine(running)


def test_a_model_with_no_exact_attention_does_not_become_ready(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On torch's kernels, attention off by 0.1% has no exact path to fall back to: the
    engine refuses to serve, naming the path."""
    real = _model._grouped_attention
    monkeypatch.setattr(_model, "_grouped_attention", lambda *a, **k: real(*a, **k) * 1.001)
    exc = _failed_start(tiny_gguf, EngineConfig(max_batch=2, **TORCH))
    assert "attention" in str(exc)


def _failed_start(path: Path, config: EngineConfig) -> SelfCheckFailed:
    """An engine's start on `path` (as the server starts one: the kernels `config.kernels`
    chooses) that must fail its self-check: the error it raised (it never became ready)."""
    engine = create_engine(
        lambda: str(path), config, CollectingSink(),
        log=structlog.wrap_logger(structlog.PrintLogger(sys.stderr)), progress=lambda _m: None,
    )  # fmt: skip
    failed: list[BaseException] = []
    ready = threading.Event()

    def run() -> None:
        try:
            engine.run(on_ready=lambda _m: ready.set())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def ended(seconds: float) -> bool:
        thread.join(seconds)
        return ready.is_set() or not thread.is_alive()

    assert wait_until(ended)
    if ready.is_set():  # it must not have: stop it, and fail
        engine.shutdown()
        thread.join(HANG_GUARD_S)
    assert not ready.is_set()
    (exc,) = failed
    assert isinstance(exc, SelfCheckFailed)
    return exc


def _check_the_real_model(real_gguf: Path, *, native_kernels: bool) -> dict[str, PathCheck]:
    """SmolLM2's whole self-check (kernels, prefill together, decode batches,
    speculation) on torch's kernels or the native ones: each path's result."""
    m = load_model(
        str(real_gguf), dtype=torch.float32, device="cpu", max_positions=512, native=native_kernels
    )
    assert m.source is not None
    with torch.inference_mode():
        check = SelfCheck(m.transformer, m.source, probe_tokens(m.tokenizer, 49152))
        check.kernels()
        assert check.together(16, lambda n: n)
        assert check.decode_batch(16, lambda n: n)
        assert check.speculative(16, lambda n: n)
    return {r.path: r for r in check.results}


def test_the_check_runs_on_the_real_default_model_within_its_tolerances(
    real_gguf: Path,
) -> None:
    """SmolLM2's every fast path passes, each within its tolerance, on the CPU at hand
    (the suite runs this under ATEN_CPU_CAPABILITY=default and avx2 too)."""
    paths = _check_the_real_model(real_gguf, native_kernels=False)
    assert set(paths) == {
        "dequantizer", "embedding", "int4_kernel", "head", "attention", "prefill_together",
        "decode_batch", "speculative",
    }  # fmt: skip
    assert all(r.ok for r in paths.values()), paths
    assert paths["int4_kernel"].error < paths["int4_kernel"].tolerance / 2


def test_the_native_check_runs_on_the_real_default_model_within_its_tolerances(
    real_gguf: Path,
) -> None:
    """SmolLM2 on the native kernels: every native path passes, each within its
    tolerance, on the CPU at hand (and under ATEN_CPU_CAPABILITY=default and avx2, where
    the kernels run their plain and AVX2 builds: tests/test_cpu_capabilities.py)."""
    from ninfer.engine._runtime import start_kernels

    choice = start_kernels(EngineConfig(), lambda _m: None)
    assert choice.native, choice.reason
    paths = _check_the_real_model(real_gguf, native_kernels=True)
    assert set(paths) == NATIVE_PATHS | {
        "dequantizer", "embedding", "prefill_together", "decode_batch", "speculative",
    }  # fmt: skip
    assert all(r.ok for r in paths.values()), paths
    assert paths["native_matmul"].error < paths["native_matmul"].tolerance / 2
    assert paths["native_layers"].error < paths["native_layers"].tolerance / 2


async def test_the_server_says_what_it_refused_on_the_console_in_the_log_and_on_ready(
    packed_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """With the int4 kernel refused, the server serves on the exact path and says so:
    a `fast_path_refused` console line, `server_start.engine.self_check`, and `/ready`'s
    `self_check.refused`."""
    from server import serve

    real = _model.Int4.native
    monkeypatch.setattr(_model.Int4, "native", lambda self, x: real(self, x) * 1.03)
    async with serve(packed_gguf, tmp_path, **TORCH) as srv, srv.client() as c:
        ready = (await c.get("/ready")).json()
        assert ready["self_check"]["refused"] == [
            {"path": "int4_kernel", "instead": "dense_float32"}
        ]
        assert "dense_float32" in ready["self_check"]["passed"]
        r = await c.post("/v1/generate", json={"prompt": "x y", "max_new_tokens": 3})
        assert r.status_code == 200
    (start,) = [rec for rec in srv.log_records() if rec["event"] == "server_start"]
    int4 = [c for c in start["engine"]["self_check"] if c["path"] == "int4_kernel"]
    assert int4 == [
        {"path": "int4_kernel", "ok": False, "error": int4[0]["error"],
         "tolerance": 2.0**-6, "instead": "dense_float32"}
    ]  # fmt: skip
    err = capfd.readouterr().err
    assert "fast_path_refused" in err
    assert "path=int4_kernel" in err


async def test_a_server_whose_model_fails_its_self_check_never_becomes_ready(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """No exact attention: `/ready` and `/health` answer 503 naming the self-check, and
    the console says which path failed."""
    from server import serve

    real = _model._grouped_attention
    monkeypatch.setattr(_model, "_grouped_attention", lambda *a, **k: real(*a, **k) * 1.001)
    async with serve(tiny_gguf, tmp_path, **TORCH) as srv, srv.client() as c:
        ready = await c.get("/ready")
        health = await c.get("/health")
        generate = await c.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 2})
    assert ready.status_code == health.status_code == generate.status_code == 503
    assert "SelfCheckFailed" in health.text
    assert "attention" in capfd.readouterr().err


_FIRST_EXP = """
import sys, torch
torch.set_num_threads(2)
from ninfer.engine._loader import load_model  # importing the loader must not be enough
from ninfer.engine._invariance import prime_vector_math
prime_vector_math()  # what load_model does first
x = -torch.rand(9216, generator=torch.Generator().manual_seed(0)) * 4
error = ((torch.exp(x).double() - torch.exp(x.double())).abs() / torch.exp(x.double())).max()
print(float(error))
"""


def test_the_first_vector_math_of_a_process_is_exact() -> None:
    """A process's first `torch.exp` over a few thousand elements on two threads came
    out, in about one process in two, with errors up to 1.5e-4 (MKL's low-accuracy
    mode, a first-call race), and the self-check refused to start the server. Primed
    on one thread first, as `load_model` does, it is exact in every fresh process (six
    here: unprimed, all six exact would happen about once in 64)."""
    import subprocess
    import sys

    for _ in range(6):
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_EXP],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            check=True,
        )
        assert float(out.stdout) < 1e-6, out.stdout


# ---- verdicts kept between starts (--self-check cached) -------------------------------


def _counting_checks(mp: pytest.MonkeyPatch) -> list[int]:
    """SelfCheck.kernels wrapped to count its runs (one a start that checks)."""
    real, runs = SelfCheck.kernels, []

    def counted(self: SelfCheck) -> None:
        runs.append(1)
        real(self)

    mp.setattr(SelfCheck, "kernels", counted)
    return runs


def _verdicts(where: Path) -> list[Path]:
    return sorted(where.glob("*.json")) if where.is_dir() else []


def test_a_start_of_the_same_everything_adopts_the_kept_verdict(
    packed_gguf: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With verdicts kept, the first start checks and keeps its verdict; a second start
    of the same file and settings adopts it without checking (the same paths, errors,
    batch sizes and prefilling, the same tokens); another setting, another file, or the
    engine's code changed each make a start check again; without a cache directory
    every start checks."""
    where = tmp_path / "checks"
    runs = _counting_checks(monkeypatch)
    config = EngineConfig(max_batch=4, check_cache=str(where))
    first, first_tokens = _checks(packed_gguf, config)
    assert (len(runs), len(_verdicts(where))) == (1, 1)
    second, second_tokens = _checks(packed_gguf, config)
    assert len(runs) == 1  # adopted
    assert second.self_check == first.self_check
    assert all(c.ok for c in second.self_check)
    assert (second.batch_sizes, second.prefill_together_rows, second.kernels) == (
        first.batch_sizes, first.prefill_together_rows, first.kernels
    )  # fmt: skip
    assert second_tokens == first_tokens
    assert second.kv_sizing is not None
    assert first.kv_sizing is not None
    assert (second.kv_sizing.kv_dtype, second.kv_sizing.tokens) == (
        first.kv_sizing.kv_dtype, first.kv_sizing.tokens
    )  # fmt: skip
    _checks(packed_gguf, EngineConfig(max_batch=2, check_cache=str(where)))
    assert (len(runs), len(_verdicts(where))) == (2, 2)
    _checks(tiny_gguf, config)
    assert (len(runs), len(_verdicts(where))) == (3, 3)
    # the engine's code is in the key: any change of it is another key
    real = _checkcache._digest_files
    monkeypatch.setattr(
        _checkcache, "_digest_files", lambda paths: real(paths) + ("x" if len(paths) > 1 else "")
    )
    _checks(packed_gguf, config)
    assert len(runs) == 4
    monkeypatch.setattr(_checkcache, "_digest_files", real)
    _checks(packed_gguf, config)
    assert len(runs) == 4  # the first key's verdict still kept
    _checks(packed_gguf, EngineConfig(max_batch=4))
    assert len(runs) == 5


def test_a_start_with_a_refusal_keeps_no_verdict(
    packed_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start whose self-check refuses a path (a native final norm 0.1% off, planted)
    keeps no verdict: the next start checks again, and, the kernels right again,
    passes and keeps its own."""
    where = tmp_path / "checks"
    config = EngineConfig(max_batch=4, check_cache=str(where))
    served, _ = _checks(packed_gguf, config, lambda: _scale_function(
        monkeypatch, native, "rmsnorm", 1.001))  # fmt: skip
    assert not _by_path(served.self_check)["native_final_norm"].ok
    assert _verdicts(where) == []
    monkeypatch.undo()
    runs = _counting_checks(monkeypatch)
    served, _ = _checks(packed_gguf, config)
    assert (len(runs), served.kernels.split()[0]) == (1, "native")
    assert len(_verdicts(where)) == 1


@pytest.mark.parametrize(
    "spoil",
    [
        lambda body: body["verdict"]["self_check"][0].update(ok=False),
        lambda body: body.update(version=body["version"] + 1),
        lambda body: body["verdict"].pop("batch_sizes"),
        lambda body: body.update(key="0" * 32),
        None,  # not JSON at all
    ],
)
def test_a_verdict_this_code_did_not_write_is_not_adopted(
    spoil: Callable[[dict[str, Any]], Any] | None,
    packed_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept verdict with a refused path, another version, a field missing, another
    key, or not JSON, is not adopted: the start checks and keeps a sound one."""
    where = tmp_path / "checks"
    config = EngineConfig(max_batch=4, check_cache=str(where))
    _checks(packed_gguf, config)
    (kept,) = _verdicts(where)
    body = json.loads(kept.read_text())
    if spoil is None:
        kept.write_text("{not json")
    else:
        spoil(body)
        kept.write_text(json.dumps(body))
    runs = _counting_checks(monkeypatch)
    _checks(packed_gguf, config)
    assert len(runs) == 1
    assert json.loads(kept.read_text())["verdict"]["self_check"][0]["ok"] is True


def test_kept_verdicts_are_pruned_to_the_most_recently_used(tmp_path: Path) -> None:
    """Past KEPT_VERDICTS files the least recently used go; adopting one marks it used."""
    verdict = _checkcache.Verdict(
        self_check=(PathCheck("head", True, 1e-7, 1e-5),), kv_dtype="float16",
        batch_sizes=(1, 2), together_rows=256, speculative="none", native_top_p=True,
        native_top_k=True, native_sample=True, seconds=1.0, checked_at="2026-12-07T00:00:00Z",
    )  # fmt: skip
    keys = [f"{i:032x}" for i in range(_checkcache.KEPT_VERDICTS + 1)]
    for age, key in enumerate(keys):
        assert _checkcache.write_verdict(str(tmp_path), key, {}, verdict) == ""
        os.utime(tmp_path / f"{key}.json", (1_000_000 + age, 1_000_000 + age))
    assert _checkcache.read_verdict(str(tmp_path), keys[1]) == verdict  # used: now newest
    _checkcache.write_verdict(str(tmp_path), "f" * 32, {}, verdict)
    left = {p.stem for p in tmp_path.glob("*.json")}
    assert len(left) == _checkcache.KEPT_VERDICTS
    assert (keys[0] in left, keys[1] in left, keys[2] in left) == (False, True, False)
