"""The engine's known-answer self-check: every fast path it chose, run before it serves.

A kernel that computes wrong on one CPU (a vector path torch's tests never met, a
library build, a dispatch bug) turns into wrong answers with a green CI elsewhere:
SmolLM2 once answered in French on AVX2 machines only. So at start-up, on the
model's own weights and a few real token rows (the model's tokenization of a fixed
text), each fast path is compared with the float64 computation of the file's
dequantized values, its worst row's relative error |fast - ref| / |ref| against a
tolerance:

- `dequantizer`: torch's dequantization of each tensor type the matrices were loaded
  from (64 rows of one tensor a type), exactly equal to the `gguf` package's numpy
  dequantizer (llama.cpp's reference), which the references below then rely on;
- `embedding`: torch's decoding of the probe tokens' stored rows, exactly the
  `gguf` package's (the tied head's table is decoded the same way);
- `int4_kernel`: every packed matrix of the checked layers (below) through
  `_weight_int4pack_mm_for_cpu` (every output, each matrix fed the inputs the layer's
  own matrices make: no whole-layer check stands behind torch's kernels), within 2^-6
  (it rounds inputs, scales and outputs to bfloat16: ~2^-9 a value);
- `dense_float32`: the checked layers' float32 matrices through oneDNN (or MKL),
  within 1e-5 (float32 rounding measures ~1e-7); `dense_bfloat16` /
  `narrowed_bfloat16` within 2^-6;
- `head`: the output head (16,384 rows of the vocabulary: the first and last 2,048
  and evenly spaced ones between), within 1e-5;
- `attention`: `_model._attention` on layer 0's real queries, keys and values with a
  causal mask, within 1e-5;
- `prefill_together`, `decode_batch`: prompts in one prefill pass (and a prompt in a
  decode step's pass, beside its row), rows of different lengths in one padded decode
  batch, bit-identical to each alone;
- `speculative` (with --spec): a row verifying a draft beside a plain row, in one
  pass, gets at every drafted position the logits plain one-token steps give there,
  bit for bit.

On the native kernels (`_native`), before the rest:

- `native_dequant`: each packed matrix's values (64 rows spread over one matrix of each
  stack of tensor types) exactly the `gguf` package's;
- `native_matmul`: every matrix of the checked layers, each fed the inputs the layer's
  own matrices make, on 1,024 output rows of each stored part (the first and last 128
  and evenly spaced ones between: `native_layers` below computes every output), within
  1e-5 (they measure ~5e-7);
- `native_head`: the head as `head` above, within 1e-5;
- `native_attention`: layer 0's attention over the page pool, within 1e-5;
- `native_layers`: each checked layer whole (norms, rotation, keys and values written and
  attended to, activation, residual) on the probe prompt against a float64 layer from
  the same input, the change it makes to the residual stream (or 1% of the stream,
  where the change is smaller) within 1e-4: every output of each matrix of those
  layers, not a sample;
- `native_final_norm`: the norm before the head on the probe rows, within 1e-5;
- `native_kv_float16` (with a float16 pool, the default beside float32 activations):
  layer 0 writing the probe prompt's keys and values to a float16 pool stores exactly
  numpy's nearest half of each key and value it writes to a float32 pool, and native
  attention over the float16 pool is within 1e-5 of float64 attention over those
  values (`kv_float16` checks torch's pool the same way where torch's kernels serve);
  refused, the pool stores float32;
- `native_kv_int8` (with --kv-dtype int8): layer 0 writing the probe prompt's keys and
  values to an int8 pool gives exactly the codes and scales a float64 quantizer gives
  for the keys and values it writes to a float32 pool, and attention over the int8
  pool reads them back: within 1e-5 of float64 attention over those values.

A native path that fails sends the whole model to torch's kernels (--weights), which
are then checked as above; with --kv-dtype int8, `kv_int8` checks torch's way of
writing and reading the pool the same way (no exact path left: not ready).

`native_top_k` (where the native kernels serve): the tokens the sampler's top-k keeps,
found on the native kernels (a heap over one pass), exactly torch.topk's and the ties
with the k-th, on the probe rows' logits, rows of ties and rows with banned tokens;
refused, torch's top-k serves.

`native_top_p` (where the native kernels serve): the sampler's top-p on the native
kernels keeps exactly the ids the full sort keeps (`top_p_kept`), and draws the same
tokens from them, on four of the probe rows' real distributions at several
temperatures and top_p values and on rows of ties; refused, the sampler uses the full sort.

`native_sample` (where the native kernels serve, and top-k and top-p passed): the
step's batched sampler (`torch.ops.ninfer.sample`) picks the token its float64
definition (`_sampling.reference_pick`) picks, on four of the probe rows, a row of ties
and a row with banned tokens, at several temperatures, top-k, min-p and top-p values and
draws, every row once in one call; where they differ the float64 pick moved by 1e-5 of
the draw's target, min-p's floor or top-p's bound (the float32 exponential's reach) must
give the native one; refused, each row is sampled alone with torch calls.

A path that fails is not used: the engine falls back to the next exact path (int4
kernel -> its matrices dequantized to float32; oneDNN -> MKL; torch embedding
decoding -> numpy's; narrowing -> none; prefilling together -> one prompt a pass;
decode batches -> every step padded to the largest batch; speculation -> none; native
top-p -> the full sort) and checks that one too.
Where nothing exact is left (the dequantizer, attention, a float32 matmul through
both libraries), the model does not become ready.

The checked layers (`checked_layers`) are the first, the last, and the first layer of
every other form a layer takes: another stored type or shape of one of its matrices
(a Q4_K_M file stores some layers' attn_v and ffn_down as Q6_K), sliding-window or
global attention, a bias or an extra norm. A kernel's path is chosen by those, not by
the values, so every path the model runs is checked on its own weights, and the
check costs a few layers' float64 forward however deep the model is (a 24-layer
1.7B model's check once took 110 s of its start-up, most of it every layer's
matrices dequantized to float64 twice; now each checked layer's matrices are
decoded whole once, for `native_layers` on the native kernels or for each matrix's
own check on torch's, and widened to float64 a block of rows at a time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from ninfer.engine import _native, _sampling
from ninfer.engine._contract import PathCheck, SamplingParams
from ninfer.engine._errors import EngineError
from ninfer.engine._gguf import GGUFFile, ModelArgs, decode_blocks
from ninfer.engine._kvpool import KVPages, pages_for
from ninfer.engine._model import (
    LAYER_TENSORS,
    Dense,
    Int4,
    Linear,
    Transformer,
    _attention,
    _narrowed,
    reference_rows,
)
from ninfer.engine._native import Packed
from ninfer.engine._speculative import step_logits
from ninfer.engine._tokenizer import TextTokenizer

__all__ = ["BFLOAT16_TOLERANCE", "FLOAT32_TOLERANCE", "SelfCheck", "SelfCheckFailed"]

FLOAT32_TOLERANCE = 1e-5
# The k values the native top-k is checked at (a request's top_k: llama-server's 40, and
# others a client sends).
TOP_K_VALUES = (1, 2, 40, 64, 1000)
BFLOAT16_TOLERANCE = 2.0**-6
# A native layer's change to the residual stream against float64 (judged against at least
# 1% of the stream): a few dozen float32 roundings deep (norms, matmuls, attention,
# activation); measured 1e-6..6e-6 on SmolLM2.
LAYER_TOLERANCE = 1e-4

# The real text whose tokens the paths are checked on (a few kinds of text: words,
# digits one by one, code, punctuation, non-Latin scripts).
PROBE_TEXT = "The capital of France is Paris. 12 + 30 = 42; def f(x): return x * 2  # Émile, 東京"
PROBE_ROWS = 16
# The head is checked on this many rows of the vocabulary, the first and last
# HEAD_EDGE of them among them.
HEAD_SAMPLE = 16384
HEAD_EDGE = 2048
# A layer matrix's own check (`_layers`) compares this many output rows of each of its
# stored parts (q, k and v; gate and up) with float64, the first and last MATRIX_EDGE
# among them (where the kernels' panels and a stack's parts have their edges) and
# evenly spaced rows between, so no whole matrix is decoded to float64 for it; the
# whole-layer check (`_native_layers`) still computes every output of the checked
# layers against float64.
MATRIX_SAMPLE = 1024
MATRIX_EDGE = 128
# Rows of a matrix widened to float64 at a time for the whole-layer reference (16 MiB of
# float64 at 2,048 inputs, 64 MiB at 8,192).
REFERENCE_ROWS = 1024
# Rows of one tensor of each type whose dequantization is checked.
DEQUANT_ROWS = 64
# The draft a verifying pass is checked with (`speculative`): this many tokens.
DRAFT_CHECK = 4
# Top-p is checked at these temperatures and top_p values (`top_p`), with this many
# draws a distribution.
TOP_P_TEMPERATURES = (0.5, 1.0, 2.0)
TOP_P_VALUES = (0.1, 0.5, 0.9, 0.95, 0.999)
TOP_P_DRAWS = 4
# ... on this many of the probe rows a temperature, spread over the prompt (each row is a
# full sort of the vocabulary and more: 16 rows made a third of a 1B model's start-up).
TOP_P_ROWS = 4
# ... and on rows of ties this long (`top_p`).
TOP_P_TIE_ROW = 4099
# The batched sampler's cases (`sample`): (k, temperature, min_p, top_p), each with
# SAMPLE_DRAWS draws, on each row; SAMPLE_SLACK: a boundary's reach (see `sample`).
SAMPLE_CASES = (
    (40, 0.8, 0.05, 0.95),
    (40, 1.0, 0.0, 1.0),
    (1, 0.7, 0.0, 1.0),
    (64, 2.0, 0.1, 0.5),
    (1000, 0.5, 0.0, 0.9),
    (5, 1e-6, 0.0, 1.0),
)
SAMPLE_DRAWS = 4
SAMPLE_SLACK = 1e-5


class SelfCheckFailed(EngineError):
    """No exact path is left for part of the model: it must not serve."""


def probe_tokens(tokenizer: TextTokenizer, vocab: int) -> list[int]:
    """Up to PROBE_ROWS real tokens of PROBE_TEXT (ids spread over the vocabulary where
    the tokenizer gives fewer than 8)."""
    ids = [t for t in tokenizer.encode(PROBE_TEXT) if 0 <= t < vocab][:PROBE_ROWS]
    if len(ids) < 8:
        ids = [(i * 7919 + 3) % vocab for i in range(PROBE_ROWS)]
    return ids


def _rel(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's relative error, |fast - ref| / |ref| (rows of `ref` float64)."""
    diff = (fast.double() - ref).norm(dim=-1)
    scale = ref.norm(dim=-1).clamp_min(1e-30)
    out = (diff / scale).max().item()
    return float("inf") if out != out else float(out)  # NaN: as wrong as it gets


def _spread(n: int, sample: int, edge: int) -> torch.Tensor:
    """Rows 0..n-1 where n <= sample; else the first and last `edge` of them and evenly
    spaced rows between, `sample` in all."""
    rows = torch.arange(n)
    if n <= sample:
        return rows
    between = torch.linspace(edge, n - edge - 1, sample - 2 * edge).long()
    return torch.cat([rows[:edge], between, rows[-edge:]])


def _path_of(m: Linear) -> str:
    if isinstance(m, Packed):
        return "native_matmul"
    if isinstance(m, Int4):
        return "int4_kernel"
    return "dense_float32" if m.weight.dtype == torch.float32 else "dense_bfloat16"


@attrs.define(eq=False)
class SelfCheck:
    """The checks of one model, in the order the engine runs them."""

    model: Transformer
    source: GGUFFile
    tokens: list[int]
    weights: str = "int4"  # the torch path's matrices, where the native ones are refused
    # What the served KV pool stores (--kv-dtype resolved; auto: the activations' dtype):
    # "int8" and "float16" check their paths too, and the whole passes run on such a pool
    kv_dtype: str = "auto"
    results: list[PathCheck] = attrs.field(factory=list)
    seconds: float = 0.0
    _inputs: dict[str, torch.Tensor] = attrs.field(factory=dict)
    _checked: list[int] = attrs.field(factory=list)  # checked_layers(), once worked out
    # The whole-pass checks' pool a page size: the pool, the prompts' hidden states
    # alone, and the pool's pages as the prompts left them (`_prefilled`)
    _pools: dict[int, tuple[KVPages, list[torch.Tensor], list[torch.Tensor]]] = attrs.field(
        factory=dict
    )

    # ---- kernels, on real rows --------------------------------------------------------

    def kernels(self) -> None:
        """The embedding, every layer matrix, the head and attention; falling back where
        a path fails. Raises SelfCheckFailed where no exact path is left."""
        started = time.perf_counter()
        try:
            self._dequantizer()
            if self.model.native is not None:
                if self._native():
                    self._embedding()
                    return
                self.model.to_torch(self.source, self.weights)
                self._inputs.clear()
            self._embedding()
            errors = self._layers()
            if "int4_kernel" in errors:
                worst = max(e for _, _, e in errors["int4_kernel"])
                dense = "dense_float32" if self.model.dtype == torch.float32 else "dense_bfloat16"
                if not self._record("int4_kernel", worst, BFLOAT16_TOLERANCE, dense):
                    self.model.unpack_int4(self.source)
                    errors = self._layers()
            if "dense_bfloat16" in errors:  # --dtype bfloat16: nothing exact to fall to
                worst = max(e for _, _, e in errors["dense_bfloat16"])
                if not self._record("dense_bfloat16", worst, BFLOAT16_TOLERANCE):
                    raise SelfCheckFailed(f"bfloat16 matmuls compute wrong ({worst:.3g})")
            self._float32(errors)
            self._attention()
            if self.kv_dtype == "int8":
                error = self._kv_int8()
                if not self._record("kv_int8", error, FLOAT32_TOLERANCE):
                    raise SelfCheckFailed(f"the int8 KV pool computes wrong ({error:.3g})")
        finally:
            self.seconds += time.perf_counter() - started

    def _native(self) -> bool:
        """The native paths, in order, until one fails (recorded, with torch's kernels
        instead): whether every one passed."""
        instead = f"torch kernels ({self.weights})"
        checks: list[tuple[str, Callable[[], float], float]] = [
            ("native_dequant", self._native_dequant, 0.0),
            ("native_matmul", lambda: max(e for _, _, e in self._layers()["native_matmul"]),
             FLOAT32_TOLERANCE),
            ("native_head", self._head_error, FLOAT32_TOLERANCE),
            ("native_attention", self._native_attention, FLOAT32_TOLERANCE),
            ("native_layers", self._native_layers, LAYER_TOLERANCE),
            ("native_final_norm", self._native_final_norm, FLOAT32_TOLERANCE),
        ]  # fmt: skip
        if self.kv_dtype == "int8":
            checks.append(("native_kv_int8", self._native_kv_int8, FLOAT32_TOLERANCE))
        return all(self._record(path, error(), tol, instead) for path, error, tol in checks)

    def _native_final_norm(self) -> float:
        """The native norm before the head (`_native.rmsnorm`, as `Transformer.logits`
        runs it) on the probe rows against float64."""
        a = self.model.args
        x = self._x()
        fast = _native.rmsnorm(x, self.model.norm, a.norm_eps)
        ref = _reference_rms(x.double(), self.model.norm, a.norm_eps)
        return _rel(fast, ref)

    def _native_kv_int8(self) -> float:
        """Layer 0 on the native kernels writing the probe prompt's keys and values to an
        int8 pool and to a float32 one: the int8 pool must hold exactly the float64
        quantizer's codes and scales of what the float32 one holds (else 1.0); then
        native attention over the int8 pool against float64 attention over those
        values (the relative error)."""
        plain, int8, plan = self._layer0_written("int8")
        _, _, write_page, offsets = plan
        assert int8.k_scale is not None
        assert int8.v_scale is not None
        values = []
        for stored, codes, scales in ((plain.k, int8.k, int8.k_scale),
                                      (plain.v, int8.v, int8.v_scale)):  # fmt: skip
            held = _slots(plain, stored, write_page, offsets)  # (N, G, D) float32
            want_codes, want_scales = _reference_int8(held)
            got_codes = _slots(int8, codes, write_page, offsets)
            got_scales = scales[0, write_page, :, offsets]  # (N, G, 1)
            if not (torch.equal(got_codes, want_codes) and torch.equal(got_scales, want_scales)):
                return 1.0
            values.append(got_codes.double() * got_scales.double())
        return self._native_pool_attention(int8, plan, values[0], values[1])

    def _layer0_written(self, kv_dtype: str) -> tuple[KVPages, KVPages, tuple[torch.Tensor, ...]]:
        """Layer 0 on the native kernels, from the probe rows, writing its keys and values
        to a float32 pool and to a `kv_dtype` one: (the float32 pool, the other, the
        prompt's plan: page table, positions, each position's page and offset)."""
        model, native = self.model, self.model.native
        assert native is not None
        N = len(self.tokens)
        plan = self._prompt_plan(N, 16)
        table, positions, write_page, offsets = plan
        rope = model.rope.pairs(N)
        rope_local = rope if model.rope_local is None else model.rope_local.pairs(N)
        pools = [self._scratch(16), self._scratch(16, kv_dtype=kv_dtype)]
        for kv in pools:
            native.forward(self._x().clone().contiguous(), rope, rope_local, positions,
                           write_page, offsets, torch.zeros(N, dtype=torch.long), table, kv,
                           layers=(0, 1))  # fmt: skip
        return pools[0], pools[1], plan

    def _native_pool_attention(
        self, kv: KVPages, plan: tuple[torch.Tensor, ...], k64: torch.Tensor, v64: torch.Tensor
    ) -> float:
        """Native attention of layer 0's probe queries over the pool `kv` (written by
        `_layer0_written`, `plan` its prompt's) against float64 attention over the keys
        and values it holds (k64, v64: (N, G, D) float64): the relative error."""
        a = self.model.args
        table, positions, _, _ = plan
        q, _, _ = self._probe_qkv()
        scale = _attn_scale(a)
        fast = _native.attention(
            q, kv, 0, table, torch.zeros(len(self.tokens), dtype=torch.long), positions,
            window=0, scale=scale, softcap=a.attn_softcap,
        )  # fmt: skip
        ref = _reference_attention(q, k64, v64, positions, 0, scale, a.attn_softcap)
        return _rel(fast.reshape(-1, a.head_dim), ref.reshape(-1, a.head_dim))

    def _kv_int8(self) -> float:
        """torch's int8 pool (`KVPages.write` and `gather`) on layer 0's probe keys and
        values: what it reads back must be exactly the float64 quantizer's values
        (else 1.0); then attention over them against float64 (the relative error)."""
        q, k, v = self._probe_qkv()
        kv = self._scratch(16, kv_dtype="int8", keys_transposed=False)

        def dequantized(rows: torch.Tensor) -> torch.Tensor:
            codes, scales = _reference_int8(rows.float())
            return (codes.double() * scales.double()).float()

        return self._torch_pool(kv, q, k, v, dequantized)

    def _torch_pool(
        self,
        kv: KVPages,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        stored: Callable[[torch.Tensor], torch.Tensor],
    ) -> float:
        """Layer 0's probe keys and values written to torch's pool `kv` and gathered back:
        each must read back exactly as `stored` (their float32 values as the pool's
        definition stores them, (N, G, D)) gives (else 1.0); then torch's attention over
        them against float64 attention over those values (the relative error)."""
        a = self.model.args
        N, G, D = len(self.tokens), a.n_kv_heads, a.head_dim
        table, positions, write_page, offsets = self._prompt_plan(N, kv.page_size)
        dev = self.model.device
        slots = kv.slots(write_page.view(N, 1).to(dev), offsets.view(N, 1).to(dev))
        kv.write(0, slots, k.float().view(N, 1, G, D).to(dev), v.float().view(N, 1, G, D).to(dev))
        read = kv.gather(0, kv.blocks(table.to(dev)), 1)  # each (G, pages * S, D)
        values = []
        for rows, back in zip((k, v), read, strict=True):
            want = stored(rows)  # (N, G, D), as gathered
            if not torch.equal(back[:, :N].transpose(0, 1).cpu(), want):
                return 1.0
            values.append(want.double())
        causal = torch.ones(N, N, dtype=torch.bool, device=dev).tril()
        fast = _attention(
            q.float().transpose(0, 1).unsqueeze(0).to(dev),  # (1, H, N, D)
            read[0][:, :N].unsqueeze(0),  # (1, G, N, D)
            read[1][:, :N].unsqueeze(0),
            causal.view(1, 1, N, N),
            scale=a.attn_scale,
            softcap=a.attn_softcap,
            quantum=self.model.attn_quantum,
        )[0].transpose(0, 1)  # (N, H, D)
        scale = _attn_scale(a)
        k64, v64 = values
        ref = _reference_attention(q, k64, v64, positions, 0, scale, a.attn_softcap)
        return _rel(fast.reshape(-1, D).cpu(), ref.reshape(-1, D))

    def kv_float16(self) -> bool:
        """A float16 pool on the path that serves (native: `native_kv_float16`; torch's:
        `kv_float16`), layer 0's probe keys and values written: the pool must hold exactly
        numpy's nearest half of each (round to nearest, ties to even), and attention over
        it be within 1e-5 of float64 attention over those values. Refused, the pool
        stores float32 (`instead` says so), as under --kv-dtype float32."""
        started = time.perf_counter()
        try:
            native = self.model.native is not None
            error = self._native_kv_float16() if native else self._kv_float16()
            path = "native_kv_float16" if native else "kv_float16"
            return self._record(path, error, FLOAT32_TOLERANCE, "float32 KV cache")
        finally:
            self.seconds += time.perf_counter() - started

    def _native_kv_float16(self) -> float:
        """Layer 0 on the native kernels writing the probe prompt's keys and values to a
        float16 pool and to a float32 one: the float16 pool must hold exactly the nearest
        halves of what the float32 one holds (else 1.0); then native attention over the
        float16 pool against float64 attention over those values."""
        plain, half, plan = self._layer0_written("float16")
        _, _, write_page, offsets = plan
        values = []
        for stored, halves in ((plain.k, half.k), (plain.v, half.v)):
            want = _reference_half(_slots(plain, stored, write_page, offsets))
            got = _slots(half, halves, write_page, offsets)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                return 1.0
            values.append(got.double())
        return self._native_pool_attention(half, plan, values[0], values[1])

    def _kv_float16(self) -> float:
        """torch's float16 pool (`KVPages.write` and `gather`) on layer 0's probe keys and
        values: what it reads back must be exactly the nearest halves' values (else 1.0);
        then attention over them against float64."""
        q, k, v = self._probe_qkv()
        kv = self._scratch(16, kv_dtype="float16", keys_transposed=False)
        return self._torch_pool(kv, q, k, v, lambda rows: _reference_half(rows).float())

    # ---- sampling ------------------------------------------------------------------

    def top_p(self) -> bool:
        """The native top-p (`_sampling.native_top_p_kept`) against the full sort
        (`top_p_kept`) on the probe rows' real distributions (their logits at
        TOP_P_TEMPERATURES) and on rows of ties, at each of TOP_P_VALUES: the same ids,
        and the same TOP_P_DRAWS tokens drawn from them with a fixed generator."""
        started = time.perf_counter()
        logits = self._probe_logits()
        N, V = logits.shape
        spread = torch.linspace(0, N - 1, min(N, TOP_P_ROWS)).long()
        rows = [torch.softmax(logits[spread] / t, dim=-1) for t in TOP_P_TEMPERATURES]
        # The rows of ties are TOP_P_TIE_ROW long: every token of the last two is a
        # candidate, so each is a full sort both ways, and the kernel has no path that
        # depends on the row's length (a 128,256-token vocabulary's cost them 0.4 s).
        T = min(V, TOP_P_TIE_ROW)
        ties = torch.zeros(T)
        ties[: min(T, 64)] = 1.0  # 64 equal tokens, the rest impossible
        steps = torch.arange(T, dtype=torch.float32).remainder(8).div(8)  # 8 tied levels
        rows = [row for r in rows for row in r.unbind(0)]
        rows += [ties, torch.ones(T), torch.softmax(steps, dim=-1)]
        same = True
        for row in rows:
            for p in TOP_P_VALUES:
                ids, want = _sampling.native_top_p_kept(row, p), _sampling.top_p_kept(row, p)
                same = same and torch.equal(ids, want)
                for seed in range(TOP_P_DRAWS):  # as `RowSampler.pick` draws, each way
                    drawn = [
                        int(kept[_sampling._draw(row[kept], torch.Generator().manual_seed(seed))])
                        for kept in (ids, want)
                    ]
                    same = same and drawn[0] == drawn[1]
        self.seconds += time.perf_counter() - started
        return self._record("native_top_p", 0.0 if same else 1.0, 0.0, "the full sort")

    def top_k(self) -> bool:
        """The native top-k's tokens (`_sampling.native_top_k_ids`) against torch's
        (`top_k_ids`: torch.topk, then the ties) on the probe rows' logits and on rows of
        ties and of banned (-inf) tokens, at each of TOP_K_VALUES: the same ids."""
        started = time.perf_counter()
        logits = self._probe_logits()
        V = logits.shape[-1]
        steps = torch.arange(V, dtype=torch.float32).remainder(8)  # 8 tied levels
        banned = logits[0].clone()
        banned[::3] = float("-inf")  # a grammar's or a logit bias's bans
        rows = [*logits.unbind(0), steps, torch.zeros(V), banned]
        same = all(
            torch.equal(_sampling.native_top_k_ids(row, k), _sampling.top_k_ids(row, k))
            for row in rows
            for k in TOP_K_VALUES
            if k < V
        )
        self.seconds += time.perf_counter() - started
        return self._record("native_top_k", 0.0 if same else 1.0, 0.0, "torch's top-k")

    def sample(self) -> bool:
        """The batched native sampler (`_sampling.native_sample`) against its float64
        definition (`reference_pick`): SAMPLE_CASES on TOP_P_ROWS of the probe rows'
        logits, a row of 8 tied levels and one with a third of its tokens banned, all in
        one call per draw; a pick that differs must be the float64 pick with a boundary
        moved by SAMPLE_SLACK of itself."""
        started = time.perf_counter()
        logits = self._probe_logits()
        N, V = logits.shape
        spread = torch.linspace(0, N - 1, min(N, TOP_P_ROWS)).long()
        banned = logits[0].clone()
        banned[::3] = float("-inf")
        steps = torch.arange(V, dtype=torch.float32).remainder(8)
        rows = torch.cat([logits[spread], steps[None], banned[None]])
        cases = [c for c in SAMPLE_CASES if c[0] < V]
        same = True
        for draw in range(SAMPLE_DRAWS):
            samplers, which = [], []
            for r in range(rows.shape[0]):
                for j, (k, t, mp, tp) in enumerate(cases):
                    params = SamplingParams(temperature=t, top_k=k, min_p=mp, top_p=tp,
                                            seed=draw * 1000 + r * 10 + j)  # fmt: skip
                    samplers.append(_sampling.RowSampler.create(params, V, native_sample=True))
                    which.append(r)
            us = [float(torch.rand(1, generator=torch.Generator().manual_seed(s.seed),
                                   dtype=torch.float64)) for s in samplers]  # fmt: skip
            got = _sampling.native_sample(rows, which, samplers)
            for s, r, u, token in zip(samplers, which, us, got, strict=True):
                p = s.params
                same = same and _sampling.near_reference(
                    token, rows[r], p.top_k, p.temperature, p.min_p, p.top_p, u, SAMPLE_SLACK
                )
        self.seconds += time.perf_counter() - started
        return self._record("native_sample", 0.0 if same else 1.0, 0.0, "each row's torch calls")

    def _native_dequant(self) -> float:
        """The worst difference between a packed matrix's values and the `gguf` package's
        decoding of the file's, over DEQUANT_ROWS rows of the first matrix of each stack
        of tensor types (and the head)."""
        seen: dict[tuple[str, ...], tuple[Packed, list[str]]] = {}  # kinds -> a matrix
        for i, layer in enumerate(self.model.layers):
            for slot, names in LAYER_TENSORS.items():
                m = getattr(layer, slot)
                if isinstance(m, Packed):
                    seen.setdefault(m.kinds, (m, [f"blk.{i}.{n}" for n in names]))
        head = self.model.lm_head
        if isinstance(head, Packed):
            seen.setdefault(("head", *head.kinds), (head, [self._head_name()]))
        worst = 0.0
        for m, stack in seen.values():
            # rows spread over each tensor of the stack, its first and last among them
            starts, base = [], 0
            for name in stack:
                starts.append(base)
                base += int(self.source.tensors[name].shape[1])
            ids = sorted({int(i) for i in torch.linspace(0, base - 1, DEQUANT_ROWS).long()}
                         | set(starts) | {s - 1 for s in starts[1:]})  # fmt: skip
            ref = []
            for i in ids:
                at = max(j for j, s in enumerate(starts) if s <= i)
                kind, raw = self.source.rows_at(stack[at], torch.tensor([i - starts[at]]))
                ref.append(reference_rows(kind, raw, m.in_features))
            fast = m.rows(torch.tensor(ids))
            worst = max(worst, float((fast.double() - torch.cat(ref).double()).abs().max()))
        return worst

    def _probe_qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer 0's queries, keys and values of the probe rows: (N, heads, head dim)."""
        a = self.model.args
        if "qkv" not in self._inputs:
            lay = self.model.layers[0]
            qkv = self._reference(0, "wqkv", self._normed(0)[0].double())
            if lay.qkv_bias is not None:
                qkv = qkv + lay.qkv_bias.double()
            self._inputs["qkv"] = qkv
        return _split_qkv(self._inputs["qkv"], a)

    def _native_attention(self) -> float:
        """Layer 0's attention over the probe rows (causal) on the native kernels, the
        keys and values in a page pool, against float64."""
        a = self.model.args
        q, k, v = self._probe_qkv()
        N, D = len(self.tokens), a.head_dim
        kv = self._scratch(16)
        table, positions, write_page, offsets = self._prompt_plan(N, kv.page_size)
        kv.k[0, write_page, :, :, offsets] = k.float()  # transposed: (.., D, S)
        kv.v[0, write_page, :, offsets] = v.float()
        scale = _attn_scale(a)
        fast = _native.attention(
            q,
            kv,
            0,
            table,
            torch.zeros(N, dtype=torch.long),
            positions,
            window=0,
            scale=scale,
            softcap=a.attn_softcap,
        )
        ref = _reference_attention(q, k, v, positions, 0, scale, a.attn_softcap)
        return _rel(fast.reshape(-1, D), ref.reshape(-1, D))

    def _prompt_plan(
        self, n: int, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt of n positions on pages 1, 2, ...: its page table (1, pages), positions,
        and each position's page and offset."""
        pages = (n + page_size - 1) // page_size
        table = torch.arange(1, pages + 1).view(1, -1)
        positions = torch.arange(n)
        return table, positions, table[0, positions // page_size], positions % page_size

    def _native_layers(self) -> float:
        """Each checked native layer on the probe prompt (its keys and values written
        to a page pool, then attended to) against a float64 layer from the same input:
        the worst relative error of the change the layer makes to the residual stream.
        The layers between run natively, so each checked one sees its real input."""
        model, native = self.model, self.model.native
        assert native is not None
        N = len(self.tokens)
        kv = self._scratch(16)
        table, positions, write_page, offsets = self._prompt_plan(N, kv.page_size)
        x = self._x().clone().contiguous()
        rope = model.rope.pairs(N)
        rope_local = rope if model.rope_local is None else model.rope_local.pairs(N)
        worst = 0.0
        checked = self.checked_layers()
        for i in range(checked[-1] + 1):
            before = x.double()
            ref = self._reference_layer(i, before, positions) if i in checked else None
            native.forward(x, rope, rope_local, positions, write_page, offsets,
                           torch.zeros(N, dtype=torch.long), table, kv, layers=(i, 1))  # fmt: skip
            if ref is None:
                continue
            # The change the layer makes, row by row, against its float64 value; where a
            # row's change is under 1% of the row (SmolLM2's first position changes by
            # 0.1% in half its layers), against 1% of the row: the float32 rounding of
            # the row itself is then not taken for an error of the layer's.
            change = (ref - before).norm(dim=-1).maximum(0.01 * before.norm(dim=-1))
            err = ((x.double() - ref).norm(dim=-1) / change.clamp_min(1e-30)).max().item()
            worst = max(worst, float("inf") if err != err else err)
        return worst

    def _reference_layer(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer i in float64 on x (N, dim) float64 at `positions`: the file's matrices,
        the model's norms and rotation table (its values), attention written out."""
        a, lay = self.model.args, self.model.layers[i]
        N, H, D = x.shape[0], a.n_heads, a.head_dim

        def rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + a.norm_eps) * w.double()

        qkv = self._reference(i, "wqkv", rms(x, lay.attn_norm))
        if lay.qkv_bias is not None:
            qkv = qkv + lay.qkv_bias.double()
        q, k, v = _split_qkv(qkv, a)
        if lay.q_norm is not None and lay.k_norm is not None:
            q, k = rms(q, lay.q_norm), rms(k, lay.k_norm)
        table = self.model.rope
        if lay.local and self.model.rope_local is not None:
            table = self.model.rope_local
        rot = table.at(positions).to(torch.complex128).view(N, 1, D // 2)
        q, k = _rotate64(q, rot, a.rope_neox), _rotate64(k, rot, a.rope_neox)
        scale = _attn_scale(a)
        window = a.sliding_window if lay.local else 0
        attn = _reference_attention(q, k, v, positions, window, scale, a.attn_softcap)
        out = self._reference(i, "wo", attn.reshape(N, H * D))
        if lay.post_attn_norm is not None:
            out = rms(out, lay.post_attn_norm)
        x = x + out
        gate, up = self._reference(i, "w_gate_up", rms(x, lay.ffn_norm)).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if a.gelu else F.silu(gate)
        out = self._reference(i, "w_down", act * up)
        if lay.post_ffn_norm is not None:
            out = rms(out, lay.post_ffn_norm)
        return x + out

    def _record(self, path: str, error: float, tolerance: float, instead: str = "") -> bool:
        ok = error <= tolerance
        self.results.append(PathCheck(path, ok, error, tolerance, "" if ok else instead))
        return ok

    def _float32(self, errors: dict[str, list[tuple[int, str, float]]]) -> None:
        """The float32 matrices (layers' and head) through oneDNN, else all through MKL;
        neither exact is fatal."""
        onednn = any(isinstance(m, Dense) and m.onednn for m in self.model.linears())
        for attempt in ("", "_mkl"):
            checks = []
            if "dense_float32" in errors:
                worst = max(e for _, _, e in errors["dense_float32"])
                checks.append(("dense_float32", worst, FLOAT32_TOLERANCE))
            head = self.model.lm_head
            tolerance = (
                FLOAT32_TOLERANCE if head.input_dtype == torch.float32 else BFLOAT16_TOLERANCE
            )
            checks.append(("head", self._head_error(), tolerance))
            instead = "mkl" if onednn and not attempt else ""
            if all([self._record(p + attempt, e, t, instead) for p, e, t in checks]):
                return
            if not instead:
                failed = ", ".join(f"{r.path}: {r.error:.3g}" for r in self.results if not r.ok)
                raise SelfCheckFailed(f"float32 matmuls compute wrong ({failed})")
            self.model.use_mkl()
            errors = self._layers()

    def _embedding(self) -> None:
        emb = self.model.embedding
        ids = torch.tensor(self.tokens)
        kind, raw = self.source.rows_at("token_embd.weight", ids)
        ref = reference_rows(kind, raw, emb.dim).to(emb.dtype).double()  # as held
        fast = emb(ids.to(self.model.device)).cpu()
        if self._record("embedding", _rel(fast, ref), 0.0, "numpy decoding"):
            return
        emb.by_reference = True
        error = _rel(emb(ids.to(self.model.device)).cpu(), ref)
        if error > 0.0:
            raise SelfCheckFailed("the token embedding decodes wrong even by the reference")
        if emb.rows is not None and not self.source.has_tensor("output.weight"):
            # a tied head: decoded the same way
            head = self.model.lm_head
            dtype = head.weight.dtype if isinstance(head, Dense) else self.model.dtype
            self.model.lm_head = Dense(emb.table(dtype, self.model.device))

    def _dequantizer(self) -> None:
        """torch's dequantization of each tensor type the layers and the head were
        loaded from (the references below are made by it too) against the `gguf`
        package's, on the first rows of one tensor of each type: exact."""
        head = self._head_name()
        seen: dict[str, str] = {}
        for name, t in self.source.tensors.items():
            kind = t.tensor_type.name
            layer = name.endswith(".weight") and name != "token_embd.weight"
            if (layer or name == head) and len(t.shape) == 2:
                seen.setdefault(kind, name)
        worst = 0.0
        for kind, name in sorted(seen.items()):
            _, raw = self.source.rows(name)
            rows = raw[:DEQUANT_ROWS]
            dim = int(self.source.tensors[name].shape[0])
            ours = decode_blocks(kind, rows.reshape(-1)).float().view(-1, dim)
            worst = max(worst, _rel(ours, reference_rows(kind, rows, dim).double()))
        if not self._record("dequantizer", worst, 0.0):
            raise SelfCheckFailed(f"the weights' dequantization is wrong on this CPU ({worst:.3g})")

    def _probe_logits(self) -> torch.Tensor:
        """The head's logits of the probe rows on the path that serves, (N, V) float32 on
        the CPU: computed once for the samplers' checks (a head pass over Gemma 3's
        262,144 rows is not free)."""
        if "logits" not in self._inputs:
            self._inputs["logits"] = self.model.logits(self._x()).float().cpu()
        return self._inputs["logits"]

    def _x(self) -> torch.Tensor:
        """The probe tokens' embeddings, as the first layer sees them: (N, dim)."""
        if "x" not in self._inputs:
            a = self.model.args
            ids = torch.tensor(self.tokens, device=self.model.device)
            x = self.model.embedding(ids).float().view(len(self.tokens), a.dim)
            self._inputs["x"] = x * a.embed_scale if a.embed_scale != 1.0 else x
        return self._inputs["x"]

    def _reference(self, layer: int, slot: str, x: torch.Tensor) -> torch.Tensor:
        """x (N, inputs) float64 times layer `layer`'s matrix `slot` as the file stores it,
        in float64: (N, outputs). Each stored part decoded from its blocks and widened to
        float64 REFERENCE_ROWS rows at a time (float32 holds the values exactly: the
        reference decoder computes them in float32), rather than the whole stack decoded,
        copied, widened and concatenated (a 1B model's feed-forward is 268 MB of float64
        a copy; decoding in pieces took a 1.7B model's gate 0.12 s -> 0.08-0.11)."""
        out = []
        dim = x.shape[-1]
        for n in LAYER_TENSORS[slot]:
            kind, raw = self.source.stored(f"blk.{layer}.{n}")
            for start in range(0, raw.shape[0], REFERENCE_ROWS):
                rows = decode_blocks(kind, raw[start : start + REFERENCE_ROWS].reshape(-1))
                out.append(x @ rows.view(-1, dim).to(self.model.device).double().T)
        return torch.cat(out, dim=-1)

    def _reference_rows(self, layer: int, slot: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 values of sampled output rows of layer `layer`'s matrix `slot`
        (`_spread` over each stored part), decoded from the file's blocks of those rows
        alone: (their indices in the matrix's output, (rows, inputs) float64)."""
        index, values, start = [], [], 0
        for n in LAYER_TENSORS[slot]:
            name = f"blk.{layer}.{n}"
            dim, out = (int(d) for d in self.source.tensors[name].shape.tolist())
            rows = _spread(out, MATRIX_SAMPLE, MATRIX_EDGE)
            kind, raw = self.source.rows_at(name, rows)
            values.append(decode_blocks(kind, raw.reshape(-1)).view(-1, dim).double())
            index.append(rows + start)
            start += out
        return torch.cat(index), torch.cat(values).to(self.model.device)

    def _normed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe rows normed for layer `layer`'s attention and feed-forward."""
        a = self.model.args
        lay = self.model.layers[layer]
        x = self._x()
        h = F.rms_norm(x, (a.dim,), lay.attn_norm.float(), a.norm_eps)
        g = F.rms_norm(x, (a.dim,), lay.ffn_norm.float(), a.norm_eps)
        return h, g

    def _layer_inputs(
        self, layer: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each matrix of layer `layer`: (its input rows, the output rows checked, their
        float64 reference values), the inputs made from the probe tokens as the layer
        would see them at its start (normed embeddings; the values and the activation
        made by the layer's own matrices: each matrix is judged on its own input)."""
        a = self.model.args
        lay = self.model.layers[layer]
        h, g = self._normed(layer)
        qkv = lay.wqkv(h.to(lay.wqkv.input_dtype)).float()
        if lay.qkv_bias is not None:
            qkv = qkv + lay.qkv_bias.float()
        q_end = a.n_heads * a.head_dim
        v = qkv[:, q_end + a.kv_dim :].reshape(-1, a.n_kv_heads, 1, a.head_dim)
        heads = v.expand(-1, -1, a.n_heads // a.n_kv_heads, -1).reshape(-1, q_end)
        gate, up = lay.w_gate_up(g.to(lay.w_gate_up.input_dtype)).float().chunk(2, dim=-1)
        act = (F.gelu(gate, approximate="tanh") if a.gelu else F.silu(gate)) * up
        out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for slot, x in (("wqkv", h), ("wo", heads), ("w_gate_up", g), ("w_down", act)):
            if isinstance(getattr(lay, slot), Packed):  # `native_layers` checks every output
                rows, ref = self._reference_rows(layer, slot)
                out[slot] = (x, rows, x.double() @ ref.T)
            else:  # torch's kernels have no whole-layer check behind them: every output
                whole = self._reference(layer, slot, x.double())
                out[slot] = (x, torch.arange(whole.shape[-1]), whole)
        return out

    def checked_layers(self) -> list[int]:
        """The layers whose matrices and whole computation are checked: the first and
        the last, and the first layer of each other form a layer takes (a slot's stored
        types and shapes, e.g. the Q6_K attn_v and ffn_down a Q4_K_M file gives some
        layers; sliding-window or global attention; biases and extra norms), so every
        kernel path the model runs is checked on its real weights while the check's cost
        stays a few layers' float64 forward, whatever the model's depth."""
        if not self._checked:
            n = self.model.args.n_layers
            picked, seen = {0, n - 1}, set()
            for i, lay in enumerate(self.model.layers):
                forms: list[tuple[object, ...]] = [
                    (lay.local, lay.qkv_bias is not None, lay.q_norm is not None,
                     lay.post_attn_norm is not None)
                ]  # fmt: skip
                for names in LAYER_TENSORS.values():
                    stored = (self.source.tensors[f"blk.{i}.{name}"] for name in names)
                    forms.append(tuple((t.tensor_type.name, tuple(t.shape.tolist()))
                                       for t in stored))  # fmt: skip
                for j, form in enumerate(forms):
                    if (j, form) not in seen:
                        seen.add((j, form))
                        picked.add(i)
            self._checked = sorted(picked)
        return self._checked

    def _layers(self) -> dict[str, list[tuple[int, str, float]]]:
        """Each checked layer's matrices against their reference: (layer, slot, error)
        by path."""
        errors: dict[str, list[tuple[int, str, float]]] = {}
        for i in self.checked_layers():
            lay = self.model.layers[i]
            for slot, (x, rows, ref) in self._layer_inputs(i).items():
                m: Linear = getattr(lay, slot)
                fast = m(x.to(m.input_dtype)).float()[:, rows.to(x.device)]
                errors.setdefault(_path_of(m), []).append((i, slot, _rel(fast, ref)))
        return errors

    def narrowed(self) -> bool:
        """Whether the layers' float32 matrices, narrowed to bfloat16 as the engine would,
        compute right (checked on layer 0's real rows)."""
        started = time.perf_counter()
        inputs = self._layer_inputs(0)
        worst = 0.0
        lay = self.model.layers[0]
        for slot, (x, rows, ref) in inputs.items():
            m = _narrowed(getattr(lay, slot))
            worst = max(worst, _rel(m(x.to(m.input_dtype)).float()[:, rows.to(x.device)], ref))
        self.seconds += time.perf_counter() - started
        return self._record("narrowed_bfloat16", worst, BFLOAT16_TOLERANCE, "dense_float32")

    def _head_error(self) -> float:
        """The head over the probe rows (final-normed) against float64, on a sample of
        the vocabulary: its first and last HEAD_EDGE rows (where a kernel's blocking
        has its edges) and evenly spaced rows between, HEAD_SAMPLE in all, the
        reference rows decoded from the file's blocks by torch's dequantizer (checked
        against the `gguf` package's on this type by `_dequantizer`; the package's
        numpy took 0.5-0.6 s for a 1B model's Q6_K rows, torch's 0.2)."""
        a = self.model.args
        x = F.rms_norm(self._x(), (a.dim,), self.model.norm.float(), a.norm_eps)
        fast = self.model.lm_head(x.to(self.model.lm_head.input_dtype)).float().cpu()
        name = self._head_name()
        V = int(self.source.tensors[name].shape[1])
        rows = _spread(V, HEAD_SAMPLE, HEAD_EDGE)
        kind, raw = self.source.rows_at(name, rows)
        table = decode_blocks(kind, raw.reshape(-1)).view(-1, a.dim).double()
        return _rel(fast[:, rows], x.cpu().double() @ table.T)

    def _head_name(self) -> str:
        """The file's tensor the head is: its own, or the tied embedding."""
        return "output.weight" if self.source.has_tensor("output.weight") else "token_embd.weight"

    def _attention(self) -> None:
        """Layer 0's attention over the probe rows (causal), against float64."""
        a = self.model.args
        q, k, v = self._probe_qkv()
        N, H, G, D = len(self.tokens), a.n_heads, a.n_kv_heads, a.head_dim
        causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        fast = _attention(
            q.float().transpose(0, 1).unsqueeze(0),  # (1, H, N, D)
            k.float().transpose(0, 1).unsqueeze(0),  # (1, G, N, D)
            v.float().transpose(0, 1).unsqueeze(0),
            causal.view(1, 1, N, N),
            scale=a.attn_scale,
            softcap=a.attn_softcap,
            quantum=self.model.attn_quantum,
        )[0]  # (H, N, D)
        scale = _attn_scale(a)
        kh = k.repeat_interleave(H // G, dim=1).transpose(0, 1)  # (H, N, D)
        vh = v.repeat_interleave(H // G, dim=1).transpose(0, 1)
        scores = q.transpose(0, 1) @ kh.transpose(1, 2) * scale  # (H, N, N)
        if a.attn_softcap > 0:
            scores = torch.tanh(scores / a.attn_softcap) * a.attn_softcap
        ref = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ vh
        error = _rel(fast.reshape(-1, D), ref.reshape(-1, D))
        if not self._record("attention", error, FLOAT32_TOLERANCE):
            raise SelfCheckFailed(f"attention computes wrong ({error:.3g})")

    # ---- whole passes: rows together against rows alone ----------------------------

    def together(self, page_size: int, padded: Callable[[int], int]) -> bool:
        """Two prompts in one prefill pass get the hidden states each gets alone; and a
        prompt in a decode step's pass (the engine's mixed step: a decode row, padded as
        the engine pads it, beside the long prompt) gets its hidden states alone, the
        decode row the logits its step alone gives."""
        started = time.perf_counter()
        kv, alone = self._prefilled(page_size)
        prompts = self._prompts(page_size)
        both = self.model.hidden_many(prompts, kv)
        same = all(torch.equal(x, y) for x, y in zip(both, alone, strict=True))
        if same:
            short, _ = self._lengths()
            row = [(self.tokens[short], short, self._tables(page_size)[0])]
            kv, _ = self._prefilled(page_size)
            step_alone = self._decode(row, padded, kv)
            kv, _ = self._prefilled(page_size)
            step, prompt = self.model.hidden_many(
                [self._plain_group(row, padded, kv), prompts[1]], kv
            )
            logits = self.model.logits(step[:, -1]).float().cpu()[:1]
            same = torch.equal(prompt, alone[1]) and torch.equal(logits, step_alone)
        self.seconds += time.perf_counter() - started
        return self._record("prefill_together", 0.0 if same else 1.0, 0.0, "one prompt a pass")

    def decode_batch(
        self, page_size: int, padded: Callable[[int], int], path: str = "decode_batch"
    ) -> bool:
        """Two rows of different lengths decoded in one batch (padded as the engine pads)
        get the logits each gets alone."""
        started = time.perf_counter()
        kv, _ = self._prefilled(page_size)
        short, long = self._lengths()
        tables = self._tables(page_size)
        rows = [(self.tokens[short], short, tables[0]), (self.tokens[long], long, tables[1])]
        alone = [self._decode([r], padded, kv) for r in rows]
        together = self._decode(rows, padded, kv)
        same = torch.equal(torch.cat(alone), together)
        self.seconds += time.perf_counter() - started
        return self._record(path, 0.0 if same else 1.0, 0.0, "padded to the largest batch")

    def speculative(self, page_size: int, padded: Callable[[int], int]) -> bool:
        """Two rows verifying drafts of DRAFT_CHECK tokens as one group, beside a plain
        row, in one pass: each gets the logits plain one-token steps give at each of
        its positions, and the plain row the logits it gets alone."""
        started = time.perf_counter()
        kv, _ = self._prefilled(page_size)
        short, long = self._lengths()
        tables = self._tables(page_size)
        # Each verifying row's last token and draft: real tokens, in two new orders.
        drafts = [self.tokens[: DRAFT_CHECK + 1], self.tokens[-DRAFT_CHECK - 1 :][::-1]]
        plain_row = [(self.tokens[short], short, tables[0])]
        alone = [self._decode(plain_row, padded, kv)]
        for draft, table in zip(drafts, tables[1:], strict=True):
            alone += [self._decode([(t, long + i, table)], padded, kv) for i, t in enumerate(draft)]
        kv, _ = self._prefilled(page_size)  # the prompts alone again, as the steps began
        dev = self.model.device
        verifying = (
            torch.tensor(drafts, device=dev),
            torch.arange(long, long + DRAFT_CHECK + 1, device=dev).repeat(2, 1),
            torch.tensor(tables[1:], device=dev),
        )
        plain, (spans,) = step_logits(
            self.model, kv, self._plain_group(plain_row, padded, kv), [verifying]
        )
        assert plain is not None
        together = [plain[:1], *spans.reshape(-1, 1, spans.shape[-1]).unbind(0)]
        same = all(torch.equal(x, y) for x, y in zip(alone, together, strict=True))
        self.seconds += time.perf_counter() - started
        return self._record("speculative", 0.0 if same else 1.0, 0.0, "no speculation")

    def _lengths(self) -> tuple[int, int]:
        """The two prompts' lengths: 6 probe tokens, and all but the last 2."""
        return 6, len(self.tokens) - 2

    def _tables(self, page_size: int) -> list[list[int]]:
        """The pages of the whole-pass checks' three rows: the short prompt's (and its
        next position), the long prompt's (and a draft after it), and the long prompt's
        again (a second verifying row)."""
        short, long = self._lengths()
        first = pages_for(short + 1, page_size)
        more = pages_for(long + DRAFT_CHECK + 1, page_size)
        return [
            list(range(1, 1 + first)),
            list(range(1 + first, 1 + first + more)),
            list(range(1 + first + more, 1 + first + 2 * more)),
        ]

    def _prefilled(self, page_size: int) -> tuple[KVPages, list[torch.Tensor]]:
        """A pool holding the two prompts, each prefilled alone (and the long one again,
        copied to the third row's pages), with their hidden states: made once a page
        size and saved, and each call gives it back as the prompts left it (`restore`),
        whatever a check wrote since, instead of prefilling them again."""
        if page_size not in self._pools:
            tables = self._tables(page_size)
            kv = self._scratch(page_size, tables[-1][-1], kv_dtype=self.kv_dtype)
            alone = [self.model.hidden_many([g], kv)[0] for g in self._prompts(page_size)]
            for source, target in zip(tables[1], tables[2], strict=True):
                kv.copy_rows(source, target, page_size)
            self._pools[page_size] = (kv, alone, kv.saved())
        kv, alone, saved = self._pools[page_size]
        kv.restore(saved)
        return kv, alone

    def _scratch(
        self, page_size: int, pages: int = 8, *, kv_dtype: str = "auto",
        keys_transposed: bool | None = None,
    ) -> KVPages:  # fmt: skip
        if keys_transposed is None:
            keys_transposed = self.model.native is not None
        kv = KVPages.allocate(
            self.model.args, n_pages=max(pages, 8), page_size=page_size, dtype=self.model.dtype,
            device=self.model.device, kv_dtype=kv_dtype, keys_transposed=keys_transposed,
        )  # fmt: skip
        kv.zero_pages(list(range(1, kv.scratch_page + 1)))
        return kv

    def _prompts(self, page_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The two prompts of the probe tokens (`_lengths`), on the first two rows' pages."""
        dev = self.model.device
        out = []
        for n, pages in zip(self._lengths(), self._tables(page_size)[:2], strict=True):
            out.append((
                torch.tensor([self.tokens[:n]], device=dev),
                torch.arange(n, device=dev).view(1, -1),
                torch.tensor([pages], device=dev),
            ))  # fmt: skip
        return out

    def _decode(
        self,
        rows: Sequence[tuple[int, int, list[int]]],
        padded: Callable[[int], int],
        kv: KVPages,
    ) -> torch.Tensor:
        """One decode step of `rows` (token, position, pages), padded as the engine does:
        (rows, vocab) logits."""
        logits, _ = step_logits(self.model, kv, self._plain_group(rows, padded, kv), [])
        assert logits is not None
        return logits[: len(rows)]

    def _plain_group(
        self,
        rows: Sequence[tuple[int, int, list[int]]],
        padded: Callable[[int], int],
        kv: KVPages,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` (token, position, pages) as a plain decode step's group, padded as the
        engine pads it."""
        dev = self.model.device
        pad = padded(len(rows)) - len(rows)
        width = max(len(p) for _, _, p in rows)
        table = [p + [0] * (width - len(p)) for _, _, p in rows]
        table += [[kv.scratch_page] + [0] * (width - 1)] * pad
        return (
            torch.tensor([[t] for t, _, _ in rows] + [[0]] * pad, device=dev),
            torch.tensor([[p] for _, p, _ in rows] + [[0]] * pad, device=dev),
            torch.tensor(table, device=dev),
        )


def _split_qkv(qkv: torch.Tensor, a: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of stacked Q, K, V outputs (N, (H + 2G) D) as q (N, H, D), k and v (N, G, D)."""
    N, H, G, D = qkv.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
    q = qkv[:, : H * D].reshape(N, H, D)
    k = qkv[:, H * D : H * D + G * D].reshape(N, G, D)
    v = qkv[:, H * D + G * D :].reshape(N, G, D)
    return q, k, v


def _attn_scale(a: ModelArgs) -> float:
    """What attention's scores are scaled by: the model's own, else 1/sqrt(head dim)."""
    return a.head_dim**-0.5 if a.attn_scale is None else a.attn_scale


def _reference_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (N, dim) float64 over its root mean square, times the norm's weight: float64."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight.double().cpu()


def _reference_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows (..., D) as the int8 pool's definition quantizes them, worked in
    float64: the scale max |x| / 127 rounded once to float32, each code x / scale rounded
    once to float32, then to the nearest integer (ties to even), within +-127. float64
    holds every float32 quotient's rounding exactly, so these are the bits a float32
    quantizer that rounds correctly must give: (codes int8, scales float32 (..., 1))."""
    x = rows.double().cpu()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).float()
    div = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    codes = torch.round((x / div).float().double()).clamp(-127.0, 127.0)
    return codes.to(torch.int8), scale


def _reference_half(rows: torch.Tensor) -> torch.Tensor:
    """float32 rows as the float16 pool's definition stores them: each the nearest half,
    ties to even, by numpy's own conversion (not torch's, which the pool's write uses):
    float16, the rows' shape."""
    with np.errstate(over="ignore"):  # past the largest half: infinity, as the pool stores it
        return torch.from_numpy(rows.detach().float().cpu().numpy().astype(np.float16))


def _slots(kv: KVPages, t: torch.Tensor, page: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Layer 0's rows of the pool tensor `t` (keys or values) at the slots (page, offset):
    (N, G, D), whichever way the pool lays keys out."""
    if t is kv.k and kv.keys_transposed:
        return t[0, page, :, :, offset]  # (pages, G, D, S) indexed: (N, G, D)
    return t[0, page, :, offset]


def _rotate64(x: torch.Tensor, rot: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (N, heads, D) float64 rotated by rot (N, 1, D/2) complex128: adjacent pairs, or
    (i, i + D/2) pairs (`neox`)."""
    half = x.shape[-1] // 2
    if neox:
        xc = torch.complex(x[..., :half], x[..., half:]) * rot
        return torch.cat((xc.real, xc.imag), dim=-1)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2).contiguous()) * rot
    return torch.view_as_real(xc).flatten(-2)


def _reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Causal grouped-query attention in float64: q (N, H, D), k and v (N, G, D) of one
    prompt at `positions`; a query sees the keys at or before it (and, with a window,
    less than `window` behind). Returns (N, H, D)."""
    H = q.shape[1]
    G = k.shape[1]
    kh = k.double().repeat_interleave(H // G, dim=1).transpose(0, 1)  # (H, N, D)
    vh = v.double().repeat_interleave(H // G, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kh.transpose(1, 2) * scale  # (H, N, N)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    behind = positions.view(-1, 1) - positions.view(1, -1)
    visible = behind >= 0
    if window > 0:
        visible &= behind < window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs @ vh).transpose(0, 1)
