"""The llama transformer in torch, with a paged KV cache.

Shapes: B rows (requests), T query positions per row, D head dim, H query heads,
G kv heads, P pages per row, S tokens per page. Weights follow the GGUF layout
([out, in], torch Linear order). Q and K rows are stored in llama.cpp's
interleaved-pair rotary convention, so rotary embedding rotates adjacent pairs
(done as a complex multiply) on the weights exactly as stored.

Batch invariance: every op here is row-independent, and the reductions inside
each row (matmul over the model dimension, attention over the row's keys) do not
depend on which other rows share the batch in float32 on CPU: a request decoded
alone or in any batch gets bit-identical logits. Padding keys beyond a row's
length are masked out and read zeros (the page pool is zeroed as pages are
handed out), never garbage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from ninfer.engine import _native
from ninfer.engine._gguf import GGUFFile, ModelArgs, decode_blocks
from ninfer.engine._invariance import attention_row_quantum
from ninfer.engine._kvpool import KVPages
from ninfer.engine._native import NativeLayers, PackArena, Packed, pack_tensors

__all__ = [
    "WEIGHT_MODES", "Dense", "Embedding", "Int4", "KernelState", "Linear", "Rotations",
    "Transformer",
    "load_transformer",
]  # fmt: skip

WEIGHT_MODES = ("int4", "dense")
_GROUP = 32  # the GGUF's Q4 block: one scale (and min) per 32 weights

# Each layer matrix and the GGUF tensors it stacks (along its outputs), per block.
LAYER_TENSORS = {
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "wo": ("attn_output.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
}


class Dense:
    """y = x W^T with W held as a dense tensor (x is cast to W's dtype and back).

    A float32 matrix on the CPU multiplies through oneDNN's matmul, not MKL's (what
    `F.linear` calls): oneDNN computes a row bit-identically in any number of rows from
    2 up (measured to 300 rows at any offset, with AVX-512 and with AVX2 dispatch),
    where MKL's rows change with the row count (on one CPU only batches of 16 agreed
    for SmolLM2's head). A lone row takes oneDNN's matrix-vector path, which sums in
    another order, so it is computed as two rows. Whether that holds on the CPU at hand
    is measured at start-up like every other map (`_invariance`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.in_features = int(weight.shape[1])
        self.input_dtype = weight.dtype
        self.onednn = (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _as(self.native(x), x.dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in W's dtype (x: rows, as the model hands them over)."""
        x = _as(x, self.weight.dtype)
        if not self.onednn:
            return F.linear(x, self.weight)
        if x.dim() != 2:
            y = self.native(x.reshape(-1, self.in_features))
            return y.view(*x.shape[:-1], -1)
        if x.shape[0] == 1:  # (1, in) -> (2, in): the matrix-matrix path, row 0 of it
            return _onednn_linear(x.expand(2, -1).contiguous(), self.weight)[:1]
        return _onednn_linear(x.contiguous(), self.weight)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) W^T through oneDNN's float32 matmul: (rows, out)."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return y


class Int4:
    """y = x W^T with W kept as the GGUF's own 4-bit blocks, through torch's int4 CPU
    kernel (`_weight_int4pack_mm_for_cpu`, group 32: value = (q - 8) * scale + zero).
    The kernel takes bfloat16 inputs and scales; the output is cast back to x's dtype.
    Each output row depends only on its input row (measured at start-up like the rest)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.out_features, self.in_features = (int(d) for d in q.shape)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
        # (groups, out, 2): scale and zero per group of 32 inputs, per output.
        self.scales_zeros = (
            torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        )
        self.input_dtype = torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # (rows, in): the model's layout; no reshaping calls
            return _as(self.native(x), x.dtype)
        y = self.native(x.reshape(-1, self.in_features))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in the kernel's bfloat16 (x: rows), for a consumer that adds it to a
        float32 tensor: the sum promotes it exactly, with no conversion call between."""
        return torch._weight_int4pack_mm_for_cpu(
            _as(x, torch.bfloat16), self.packed, _GROUP, self.scales_zeros
        )


Linear = Dense | Int4 | Packed


class Embedding:
    """The token embedding kept as the file stores it (e.g. Q8_0: 262,144 x 640 for
    Gemma 3 is 178 MB stored, 671 MB in float32); the rows a step needs are decoded
    when it needs them, to exactly the values a dequantized table would hold."""

    def __init__(
        self,
        kind: str,
        rows: torch.Tensor | None,
        dim: int,
        dtype: torch.dtype,
        *,
        packed: Packed | None = None,
    ) -> None:
        self.kind = kind
        # (vocab, bytes per row) uint8, in host memory on every device; None where the
        # rows are read from the tied head's packed matrix (`packed`), which holds the
        # same values: one copy of the table instead of two (178 MB for Gemma 3 270M).
        self.rows = rows
        self.packed = packed
        self.dim = dim
        self.dtype = dtype
        vocab = int(rows.shape[0]) if rows is not None else packed.out_features if packed else 0
        self.shape = (vocab, dim)
        # Rows decoded by the `gguf` package's numpy dequantizer instead of torch ops:
        # the slower exact path, where the self-check finds the torch decoding wrong.
        self.by_reference = False

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu()
        if self.rows is None:
            assert self.packed is not None
            values = self.packed.rows(ids).to(tokens.device, self.dtype)
        else:
            values = self._decode(self.rows.index_select(0, ids)).to(tokens.device, self.dtype)
        return values.reshape(*tokens.shape, self.dim)

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored rows (rows, bytes per row) as their values, (rows, dim)."""
        assert self.rows is not None, "the table is read from the packed head"
        if self.by_reference:
            return reference_rows(self.kind, raw, self.dim)
        return decode_blocks(self.kind, raw.reshape(-1)).view(-1, self.dim)

    def table(self, dtype: torch.dtype, device: str, chunk: int = 8192) -> torch.Tensor:
        """The whole (vocab, dim) table in `dtype` (a tied output head), decoded a chunk
        of rows at a time: never the whole table in float32 at once."""
        out = torch.empty(self.shape, dtype=dtype, device=device)
        for start in range(0, self.shape[0], chunk):
            if self.rows is None:
                assert self.packed is not None
                ids = torch.arange(start, min(start + chunk, self.shape[0]))
                out[start : start + chunk] = self.packed.rows(ids)
            else:
                out[start : start + chunk] = self._decode(self.rows[start : start + chunk])
        return out


@attrs.define(eq=False)
class Layer:
    attn_norm: torch.Tensor  # (dim,)
    wqkv: Linear  # (dim + 2 * kv_dim, dim)
    wo: Linear  # (dim, dim)
    ffn_norm: torch.Tensor  # (dim,)
    w_gate_up: Linear  # (2 * ffn, dim)
    w_down: Linear  # (dim, ffn)
    qkv_bias: torch.Tensor | None = None  # (dim + 2 * kv_dim,): qwen2
    q_norm: torch.Tensor | None = None  # (head_dim,): qwen3, on each query head
    k_norm: torch.Tensor | None = None  # (head_dim,): qwen3, on each key head
    post_attn_norm: torch.Tensor | None = None  # (dim,): gemma3, on the attention output
    post_ffn_norm: torch.Tensor | None = None  # (dim,): gemma3, on the feed-forward output
    local: bool = False  # attends to a sliding window of keys (gemma3's local layers)


def reference_rows(kind: str, raw: torch.Tensor, dim: int) -> torch.Tensor:
    """Stored rows (rows, bytes per row) decoded by the `gguf` package's numpy
    dequantizer (llama.cpp's own reference): float32 (rows, dim)."""
    import gguf  # the reference, only where it is used

    qtype = gguf.GGMLQuantizationType[kind]
    values = gguf.quants.dequantize(raw.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(-1, dim)


def _rope_table(
    args: ModelArgs,
    length: int,
    device: str,
    factors: torch.Tensor | None = None,
    *,
    base: float | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """(length, D/2) complex64 rotations for positions 0..length-1. `factors` (D/2,)
    divide the frequencies: Llama 3's rope scaling, as its GGUF stores it (rope_freqs);
    `scale` divides every position (linear scaling); `base` replaces the model's. A
    position's rotation does not depend on `length`."""
    half = args.head_dim // 2
    theta = args.rope_base if base is None else base
    inv = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / args.head_dim))
    inv = inv / scale
    if factors is not None:
        inv = inv / factors.to(torch.float64)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


# Positions a rotation table covers at first; it doubles as longer rows come.
_ROPE_FIRST = 1024


@attrs.define(eq=False)
class Rotations:
    """The rotary table of a model (`_rope_table`), made for the positions rows have
    reached so far (doubling, up to `limit`): a model whose context is 32,768 does not hold
    tables for all of it from the start (Gemma 3's two were 128 MB with their float
    copies), only for what its requests use."""

    args: ModelArgs
    limit: int  # positions a row can have (the context, or less)
    device: str
    factors: torch.Tensor | None = None
    base: float | None = None
    scale: float = 1.0
    _table: torch.Tensor | None = attrs.field(default=None, init=False)  # (L, D/2) complex64
    _pairs: torch.Tensor | None = attrs.field(default=None, init=False)  # (L, D/2, 2) float32

    def _cover(self, positions: int) -> torch.Tensor:
        """The table for at least `positions` positions."""
        if self._table is None or self._table.shape[0] < positions:
            length = min(self.limit, max(_ROPE_FIRST, positions, 2 * self.length))
            self._table = _rope_table(self.args, length, self.device, self.factors,
                                      base=self.base, scale=self.scale)  # fmt: skip
            self._pairs = None
        return self._table

    @property
    def length(self) -> int:
        return 0 if self._table is None else int(self._table.shape[0])

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotations of `positions` (any shape): complex64, shape + (D/2,)."""
        return self._cover(int(positions.max()) + 1)[positions]

    def pairs(self, positions: int) -> torch.Tensor:
        """(L, D/2, 2) float32 (cos, sin) for at least `positions` positions: what the
        native layers read."""
        table = self._cover(positions)
        if self._pairs is None:
            self._pairs = torch.view_as_real(table).contiguous()
        return self._pairs


def _float(x: torch.Tensor) -> torch.Tensor:
    """x in float32 (without a call when it already is: a decode step makes thousands of
    small calls, and each costs as much as the arithmetic of many)."""
    return x if x.dtype == torch.float32 else x.float()


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _apply_rope(x: torch.Tensor, rot: torch.Tensor, *, neox: bool = False) -> torch.Tensor:
    """x (B, T, heads, D) rotated by rot (B, T, 1, D/2): on adjacent pairs (2i, 2i + 1),
    or, `neox`, on the pairs (i, i + D/2)."""
    if neox:
        half = x.shape[-1] // 2
        xc = torch.complex(_float(x[..., :half]), _float(x[..., half:]))  # (B, T, h, D/2)
        out = xc * rot
        return _as(torch.cat((out.real, out.imag), dim=-1), x.dtype)
    xc = torch.view_as_complex(_float(x).reshape(*x.shape[:-1], -1, 2))  # (B, T, h, D/2)
    out = torch.view_as_real(xc * rot).flatten(3)  # (B, T, h, D)
    return _as(out, x.dtype)


# Attention reduces over keys in blocks of this many: see `_grouped_attention`.
KEY_BLOCK = 64
# Query rows are padded to a multiple of this where no measured quantum works.
_MAX_QUANTUM = 48


def _attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    quantum: int = 1,
) -> torch.Tensor:
    """Grouped-query attention in float32 with plain matmuls and a softmax written out.

    q (B, H, T, D); keys, values (B, G, K, D); mask (B, 1, T, K), True = visible.
    Returns (B, H, T, D) float32. The keys are padded (masked) to whole key blocks
    first, as `forward` pads its page tables. Written out rather than calling torch's
    fused CPU kernel: that kernel computes a row differently depending on how many rows
    share the batch (and is slow in bfloat16); here each row is computed alone, and its
    numbers do not depend on how many masked keys it is padded with (see
    `_grouped_attention`). Scores are scaled by `scale` (default D ** -0.5), then
    soft-capped when `softcap`; `quantum`: the model's `attn_quantum`.
    """
    B, H, T, D = q.shape
    G, K = keys.shape[1], keys.shape[2]
    assert H % G == 0
    assert mask.shape == (B, 1, T, K)
    per_group = H // G
    pad = -K % KEY_BLOCK
    if pad:
        keys = F.pad(keys, (0, 0, 0, pad))
        values = F.pad(values, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    # One contiguous (B*G)-batch layout whatever the callers' strides: a batched matmul
    # over strided views can take another path at B=1 than at B>1, and a row's result
    # would then depend on the batch it is in.
    qg = _float(q).reshape(B * G, per_group * T, D).contiguous()  # a kv group's heads
    kg = _float(keys).reshape(B * G, K + pad, D).contiguous()
    vg = _float(values).reshape(B * G, K + pad, D).contiguous()
    bias = mask_bias(mask, G, per_group, quantum)
    out = _grouped_attention(qg, kg, vg, bias, scale=scale, softcap=softcap)
    return out.reshape(B, H, T, D)


def _grouped_attention(
    qg: torch.Tensor,
    kg: torch.Tensor,
    vg: torch.Tensor,
    bias: torch.Tensor,
    *,
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """`_attention` on its own layout: qg (B*G, heads per group x T, D), kg and vg
    (B*G, K, D) with K a whole number of `KEY_BLOCK`s, all contiguous float32; bias as
    `mask_bias` makes it, (B*G, K / KEY_BLOCK, rows, KEY_BLOCK) with rows the query
    rows padded to the model's quantum. Returns (B*G, heads per group x T, D).

    A row's result is the same whatever K it is padded to (masked keys beyond its own),
    whatever rows share the call and whatever batch it is in. torch's softmax and a
    matmul over all K keys sum in an order that depends on K (measured: a row's output
    changed from 1,008 to 1,024 keys), and a CPU GEMM may compute a row by another
    kernel depending on the row count (MKL's AVX2 kernel, for the rows of a partial
    6-row tile), which made a prompt's numbers depend on the chunk it was prefilled in
    (so on the prefix cache) and a decode row's on its batch. So every matmul here
    multiplies one block of KEY_BLOCK keys (a fixed shape, batched over the blocks and
    never a batch of one), over query rows padded to the quantum measured at load
    (`_invariance.attention_row_quantum`); the sums over keys are taken a block at a
    time and the blocks' sums added strictly in order (`cumsum`), so a block a row
    cannot see adds an exact zero; the maximum subtracted before `exp` is order-free."""
    BG, M, D = qg.shape
    nb, rows = bias.shape[1], bias.shape[2]
    assert kg.shape[1] == nb * KEY_BLOCK, "keys come in whole blocks"
    scale = D**-0.5 if scale is None else scale
    if rows > M:  # query rows padded to the quantum (the padding rows see every key)
        qg = F.pad(qg, (0, 0, 0, rows - M))
    if BG * nb == 1:  # a batch of one may take another kernel: computed as two
        qg, kg, vg, bias = (t.expand(2, *t.shape[1:]).contiguous() for t in (qg, kg, vg, bias))
        return _grouped_attention(qg, kg, vg, bias, scale=scale, softcap=softcap)[:1, :M]
    n = BG * nb
    # The queries once per block of keys: (B*G x blocks, rows, D); each block's keys.
    qb = qg.unsqueeze(1).expand(BG, nb, rows, D).reshape(n, rows, D)
    kb, vb, bb = kg.view(n, KEY_BLOCK, D), vg.view(n, KEY_BLOCK, D), bias.view(n, rows, -1)
    if softcap > 0:
        scores = torch.bmm(qb, kb.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap + bb
    else:  # scaled and masked by the matmul itself: one call where there were three
        scores = torch.baddbmm(bb, qb, kb.transpose(1, 2), alpha=scale)
    blocks = scores.view(BG, nb, rows, KEY_BLOCK)
    probs = torch.exp(blocks - blocks.amax(dim=(1, 3), keepdim=True))  # unnormalized
    total = probs.sum(dim=-1).cumsum(dim=1)[:, -1]  # (B*G, rows): blocks added in order
    part = torch.bmm(probs.view(n, rows, KEY_BLOCK), vb)
    out = part.view(BG, nb, rows, D).cumsum(dim=1)[:, -1] / total.unsqueeze(-1)
    return out[:, :M] if rows > M else out


def mask_bias(mask: torch.Tensor, groups: int, per_group: int, quantum: int = 1) -> torch.Tensor:
    """What attention adds to its scores for a (B, 1, T, K) mask (True = visible, K a
    whole number of key blocks): 0 where visible, -inf where not (exactly what masking
    them would give), laid out as the scores are, (B x kv groups, K / KEY_BLOCK, rows,
    KEY_BLOCK), the heads per group x T query rows padded to a multiple of `quantum`
    (padding rows see every key)."""
    B, _, T, K = mask.shape
    nb = K // KEY_BLOCK
    rows = per_group * T
    padded = rows + (-rows % quantum)
    bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    full = bias.view(B, 1, 1, T, K).expand(B, groups, per_group, T, K)
    full = full.reshape(B * groups, rows, nb, KEY_BLOCK)
    if padded > rows:
        full = F.pad(full, (0, 0, 0, 0, 0, padded - rows))
    return full.transpose(1, 2).contiguous()


@attrs.define(eq=False)
class _Group:
    """One group's layout in a forward pass, made once for every layer: its rows'
    place among the pass's positions, where their new keys go, which blocks hold
    their keys, and what each query may see."""

    B: int
    T: int
    start: int  # the group's first position among the pass's N
    write_page: torch.Tensor  # (B*T,): the page each new position's keys go to
    write_offset: torch.Tensor  # (B*T,): and the slot in it
    blocks: torch.Tensor  # the blocks its keys are in
    bias: torch.Tensor  # what each query may see, as attention adds it to its scores
    bias_local: torch.Tensor  # the same for a local layer's sliding window

    @property
    def end(self) -> int:
        return self.start + self.B * self.T

    @classmethod
    def plan(
        cls,
        model: Transformer,
        kv: KVPages,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        start: int = 0,
    ) -> _Group:
        B, T = tokens.shape
        S = kv.page_size
        # Keys in whole blocks for attention: the always-zero page 0 fills the table up.
        per_block = math.lcm(S, KEY_BLOCK) // S
        if page_table.shape[1] % per_block:
            page_table = F.pad(page_table, (0, -page_table.shape[1] % per_block))
        P = page_table.shape[1]
        assert positions.shape == (B, T)
        assert int(positions.max()) < P * S, "positions beyond the row's pages"
        # Which page slot each new position writes: page ids and offsets.
        write_page = torch.gather(page_table, 1, positions // S)
        # Key index j of a row is visible to query t iff j <= positions[t].
        key_pos = torch.arange(P * S, device=model.device)
        mask = key_pos.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)  # (B, 1, T, P*S)
        # A local layer's query sees the keys less than a window behind it.
        window = model.args.sliding_window
        mask_local = (
            mask & (key_pos.view(1, 1, 1, -1) > positions.view(B, 1, T, 1) - window)
            if window > 0
            else mask
        )
        G, per_group = model.args.n_kv_heads, model.args.n_heads // model.args.n_kv_heads
        bias = mask_bias(mask, G, per_group, model.attn_quantum)
        return cls(
            B=B,
            T=T,
            start=start,
            write_page=write_page.view(-1),
            write_offset=(positions % S).view(-1),
            blocks=kv.blocks(page_table),
            bias=bias,
            bias_local=bias
            if window <= 0
            else mask_bias(mask_local, G, per_group, model.attn_quantum),
        )

    def attend(self, model: Transformer, kv: KVPages, li: int, q: torch.Tensor) -> torch.Tensor:
        """Layer `li`'s attention for this group's queries q (B*T, 1, H, D), its keys
        already written: (B*T, H*D) float32."""
        a = model.args
        B, T, G = self.B, self.T, a.n_kv_heads
        keys, values = kv.gather(li, self.blocks, B)  # (B*G, P*S, D) each
        keys, values = _float(keys), _float(values)  # a bfloat16 pool (--dtype bfloat16)
        # Queries as (B*G, heads per group x T, D): each kv head's query heads (then
        # positions), in one contiguous block, as `_attention` lays them out.
        if T == 1:
            qg = _float(q).reshape(B * G, -1, a.head_dim).contiguous()
        else:
            qg = _float(q).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
            qg = qg.reshape(B * G, -1, a.head_dim)
        attn = _grouped_attention(
            qg,
            keys,
            values,
            self.bias_local if model.layers[li].local else self.bias,
            scale=a.attn_scale,
            softcap=a.attn_softcap,
        )  # (B*G, heads per group x T, D)
        if T == 1:
            return attn.reshape(B, a.n_heads * a.head_dim)
        return attn.reshape(B, a.n_heads, T, a.head_dim).transpose(1, 2).reshape(B * T, -1)


@attrs.frozen
class KernelState:
    """Which kernels run a model: every layer's matrices (LAYER_TENSORS' order), the
    embedding, the head and the native layers (`Transformer.kernel_state`)."""

    matrices: list[tuple[Linear, ...]]
    embedding: Embedding
    lm_head: Linear
    native: NativeLayers | None
    packed: bool


@attrs.define(eq=False)
class Transformer:
    args: ModelArgs
    embedding: Embedding  # (vocab, dim)
    layers: list[Layer]
    norm: torch.Tensor  # (dim,)
    lm_head: Linear  # (vocab, dim), the embedding's values when tied
    rope: Rotations  # the rotations of positions 0..max_positions-1
    dtype: torch.dtype
    device: str
    rope_local: Rotations | None = None  # the local layers' rotations when they differ
    packed: bool = False  # --weights int4: matmuls may take bfloat16 inputs
    # Attention pads its query rows to a multiple of this (measured at load:
    # `_invariance.attention_row_quantum`).
    attn_quantum: int = 1
    # The layers on ninfer's native kernels (every matrix `Packed`), when they run there.
    native: NativeLayers | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        kv: KVPages,
        *,
        last_only: bool,
    ) -> torch.Tensor:
        """Run T new positions for each of B rows; write their K/V, return float32 logits.

        tokens, positions: (B, T) long; positions are absolute per row.
        page_table: (B, P) long, page ids of each row (padding rows point to page 0).
        Returns (B, V) logits of each row's last position when `last_only`, else (B, T, V).
        """
        x = self.hidden(tokens, positions, page_table, kv)
        return self.logits(x[:, -1] if last_only else x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., dim) through the final norm: what the head reads, and an
        embedding request's token states (llama.cpp's `t_embd`)."""
        if self.native is not None:  # the same norm as the layers': the same bits on every CPU
            return _native.rmsnorm(x, self.norm, self.args.norm_eps)
        return F.rms_norm(x, (self.args.dim,), self.norm, self.args.norm_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (..., dim) -> (..., V)."""
        logits = self.lm_head(self.final_norm(x)).float()
        cap = self.args.final_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        kv: KVPages,
    ) -> torch.Tensor:
        """`forward` up to the final norm: (B, T, dim) hidden states, K/V written."""
        return self.hidden_many([(tokens, positions, page_table)], kv)[0]

    def hidden_many(
        self, groups: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], kv: KVPages
    ) -> list[torch.Tensor]:
        """`hidden` of several groups of rows in one pass: each group is (tokens,
        positions, page table) as `hidden` takes them, with its own B and T (a decode
        batch is one group of B rows x 1 position; prompts prefilled together are a
        group each). Every matmul runs once over all the groups' positions as rows;
        attention runs per group. Returns each group's (B, T, dim) hidden states."""
        if self.native is not None:
            return self._hidden_native(self.native, groups, kv)
        a = self.args
        plans: list[_Group] = []
        for g in groups:
            plans.append(_Group.plan(self, kv, *g, start=plans[-1].end if plans else 0))
        if len(plans) == 1:
            tokens, positions = groups[0][0].reshape(-1), groups[0][1].reshape(-1)
            page, offset = plans[0].write_page, plans[0].write_offset
        else:
            tokens = torch.cat([g[0].reshape(-1) for g in groups])
            positions = torch.cat([g[1].reshape(-1) for g in groups])
            page = torch.cat([p.write_page for p in plans])
            offset = torch.cat([p.write_offset for p in plans])
        N = positions.numel()
        slots = kv.slots(page.view(N, 1), offset.view(N, 1))  # where the new keys go
        # Each position's rotation (N, 1, 1, D/2): every head alike.
        rot = self.rope.at(positions).view(N, 1, 1, -1)
        rot_local = rot
        if self.rope_local is not None:
            rot_local = self.rope_local.at(positions).view(N, 1, 1, -1)

        # The residual stream as (N, dim) rows: the matmuls' own layout, so that no
        # layer reshapes to and from it.
        x = self.embedding(tokens).view(N, a.dim)
        if a.embed_scale != 1.0:
            x = x * a.embed_scale
        q_end = a.n_heads * a.head_dim
        k_end = q_end + a.kv_dim
        for li, layer in enumerate(self.layers):
            h = F.rms_norm(x, (a.dim,), layer.attn_norm, a.norm_eps)
            qkv = layer.wqkv(h)  # (N, dim + 2*kv_dim)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            v = qkv[..., k_end:].view(N, 1, a.n_kv_heads, a.head_dim)
            r = rot_local if layer.local else rot
            if layer.q_norm is not None and layer.k_norm is not None:
                q = qkv[..., :q_end].view(N, 1, a.n_heads, a.head_dim)
                k = qkv[..., q_end:k_end].view(N, 1, a.n_kv_heads, a.head_dim)
                q = _apply_rope(F.rms_norm(q, (a.head_dim,), layer.q_norm, a.norm_eps), r,
                                neox=a.rope_neox)  # fmt: skip
                k = _apply_rope(F.rms_norm(k, (a.head_dim,), layer.k_norm, a.norm_eps), r,
                                neox=a.rope_neox)  # fmt: skip
            else:
                # Queries and keys rotated in one pass (the same rotation for every head:
                # each head's numbers are what rotating it alone gives).
                qk = qkv[..., :k_end].view(N, 1, a.n_heads + a.n_kv_heads, a.head_dim)
                qk = _apply_rope(qk, r, neox=a.rope_neox)
                q, k = qk[:, :, : a.n_heads], qk[:, :, a.n_heads :]
            kv.write(li, slots, k, v)  # k, v (N, 1, G, D)
            if len(plans) == 1:
                attn = plans[0].attend(self, kv, li, q)
            else:
                attn = torch.cat([p.attend(self, kv, li, q[p.start : p.end]) for p in plans])
            # Each output is added to the float32 residual as the matmul gives it (its
            # dtype promoted inside the add: the same sum as converting it first).
            if layer.post_attn_norm is not None:
                out = F.rms_norm(layer.wo(attn), (a.dim,), layer.post_attn_norm, a.norm_eps)
            else:
                out = layer.wo.native(attn)  # (N, dim)
            x = x + out
            h = F.rms_norm(x, (a.dim,), layer.ffn_norm, a.norm_eps)
            gate, up = layer.w_gate_up(h).chunk(2, dim=-1)  # (N, ffn) each
            act = F.gelu(gate, approximate="tanh") if a.gelu else F.silu(gate)
            if layer.post_ffn_norm is not None:
                out = F.rms_norm(layer.w_down(act * up), (a.dim,), layer.post_ffn_norm, a.norm_eps)
            else:
                out = layer.w_down.native(act * up)
            x = x + out
        if len(plans) == 1:
            return [x.view(plans[0].B, plans[0].T, a.dim)]
        return [x[p.start : p.end].view(p.B, p.T, a.dim) for p in plans]

    def _hidden_native(
        self,
        native: NativeLayers,
        groups: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        kv: KVPages,
    ) -> list[torch.Tensor]:
        """`hidden_many` on the native layers: the groups' positions as one pass of N rows,
        each row's query seeing its own row of one page table (the groups' tables, padded
        with the zero page to one width)."""
        a = self.args
        S = kv.page_size
        width = max(int(g[2].shape[1]) for g in groups)
        tables, row_ids, shapes = [], [], []
        base = 0
        for tokens, _, table in groups:
            B, T = tokens.shape
            shapes.append((B, T))
            short = int(table.shape[1]) < width
            tables.append(F.pad(table, (0, width - int(table.shape[1]))) if short else table)
            row_ids.append(torch.arange(base, base + B).repeat_interleave(T))
            base += B
        if len(groups) == 1:
            tokens, positions = groups[0][0].reshape(-1), groups[0][1].reshape(-1)
            table, row = tables[0].contiguous(), row_ids[0]
        else:
            tokens = torch.cat([g[0].reshape(-1) for g in groups])
            positions = torch.cat([g[1].reshape(-1) for g in groups])
            table, row = torch.cat(tables), torch.cat(row_ids)
        N = positions.numel()
        write_page = table[row, positions // S]
        x = self.embedding(tokens).view(N, a.dim).float().contiguous()
        if a.embed_scale != 1.0:
            x = x * a.embed_scale
        reach = int(positions.max()) + 1
        rope = self.rope.pairs(reach)
        rope_local = rope if self.rope_local is None else self.rope_local.pairs(reach)
        native.forward(x, rope, rope_local, positions.contiguous(), write_page.contiguous(),
                       (positions % S).contiguous(), row.contiguous(), table, kv)  # fmt: skip
        out, start = [], 0
        for B, T in shapes:
            out.append(x[start : start + B * T].view(B, T, a.dim))
            start += B * T
        return out

    def kernel_state(self) -> KernelState:
        """What `to_torch` replaces, for `restore_kernels`: the engine measures a step
        each way, then keeps one."""
        mats = [tuple(getattr(layer, slot) for slot in LAYER_TENSORS) for layer in self.layers]
        return KernelState(
            matrices=mats, embedding=self.embedding, lm_head=self.lm_head, native=self.native,
            packed=self.packed,
        )  # fmt: skip

    def restore_kernels(self, state: KernelState) -> None:
        """The kernels `kernel_state` saved, back in place."""
        for layer, held in zip(self.layers, state.matrices, strict=True):
            for slot, m in zip(LAYER_TENSORS, held, strict=True):
                setattr(layer, slot, m)
        self.embedding, self.lm_head = state.embedding, state.lm_head
        self.native, self.packed = state.native, state.packed

    def to_torch(self, gguf: GGUFFile, weights: str) -> None:
        """Leave the native kernels: every matrix as the torch path holds it (`weights`),
        the head dense, the embedding's rows its own: what runs where the self-check
        refuses the native layers."""
        linear = _torch_linears(gguf, dtype=self.dtype, device=self.device, weights=weights)
        for i, layer in enumerate(self.layers):
            for slot, names in LAYER_TENSORS.items():
                setattr(layer, slot, linear(*(f"blk.{i}.{n}" for n in names)))
        self.embedding, self.lm_head = _embedding_and_head(
            gguf, dtype=self.dtype, device=self.device, arena=None
        )
        self.native = None
        self.packed = weights == "int4" and self.device == "cpu"

    def layer_maps(self) -> list[Linear]:
        """One of each kind of matrix the layers multiply by (kind, shape and dtype; a
        native matrix's packed format: a Q4_K_M file's layers mix U4K with I8KM and I8K,
        each its own kernel path)."""
        maps: dict[tuple[object, ...], Linear] = {}
        for layer in self.layers:
            for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                dtype = m.weight.dtype if isinstance(m, Dense) else None
                fmt = m.format if isinstance(m, Packed) else None
                maps.setdefault((type(m), m.in_features, _out(m), dtype, fmt), m)
        return list(maps.values())

    def row_maps(self, *, narrowed: bool = False) -> list[Linear | AttentionRows]:
        """Layer 0's matrices, one of each other kind the layers hold (`layer_maps`), the
        head, and attention with the model's head shapes: what batch invariance is
        measured on (`narrowed`: as `narrow_dense` would make the layers' matrices)."""
        layer = self.layers[0]
        maps: list[Linear] = [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        maps += [m for m in self.layer_maps() if all(m is not first for first in maps)]
        if narrowed:
            maps = [_narrowed(m) for m in maps]
        if self.native is not None:  # native attention sees no other row (the self-check
            return [*maps, self.lm_head]  # compares batched passes with rows alone)
        return [
            *maps,
            self.lm_head,
            *(
                AttentionRows(self.args, keys, self.device, self.attn_quantum)
                for keys in (16, 48, 272)
            ),
        ]

    @property
    def narrowable(self) -> bool:
        """Whether packed mode left float32 matrices in the layers (types the int4 kernel
        cannot hold: Q5_0, Q8_0, Q6_K...)."""
        return self.packed and any(
            isinstance(m, Dense) and m.weight.dtype == torch.float32
            for layer in self.layers
            for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
        )

    def linears(self) -> list[Linear]:
        """Every matrix the model multiplies by: each layer's, then the head."""
        maps: list[Linear] = []
        for layer in self.layers:
            maps += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        return [*maps, self.lm_head]

    def unpack_int4(self, source: GGUFFile) -> None:
        """Every int4-kernel matrix of the layers as its dequantized values in `dtype`
        (the file's values exactly, in float32): the exact path where the int4 kernel
        is not to be used."""
        for i, layer in enumerate(self.layers):
            for slot, names in LAYER_TENSORS.items():
                if isinstance(getattr(layer, slot), Int4):
                    w = torch.cat([source.tensor(f"blk.{i}.{n}", self.dtype) for n in names])
                    setattr(layer, slot, Dense(w.to(self.device)))
        self.packed = False

    def use_mkl(self) -> None:
        """Every float32 matrix through `F.linear` (MKL), not oneDNN."""
        for m in self.linears():
            if isinstance(m, Dense):
                m.onednn = False

    def narrow_dense(self) -> None:
        """Keep the layers' float32 matrices in bfloat16: the same rounding of their
        inputs as the int4 matmuls, half the bytes (the head stays float32). The engine does
        this when float32 matmuls would batch invariantly at less than half the batch
        sizes (on this CPU, Gemma 3 270M's float32 shapes agree only in batches of 16,
        so every decode step would be padded to 16 rows)."""
        for layer in self.layers:
            layer.wqkv, layer.wo = _narrowed(layer.wqkv), _narrowed(layer.wo)
            layer.w_gate_up, layer.w_down = _narrowed(layer.w_gate_up), _narrowed(layer.w_down)


def _narrowed(m: Linear) -> Linear:
    if isinstance(m, Dense) and m.weight.dtype == torch.float32:
        return Dense(m.weight.to(torch.bfloat16))
    return m


class AttentionRows:
    """Attention of one decode query per row over `keys` cached keys and values of its
    own, as a map from rows to rows: the batched matmuls inside `_attention` may pick
    their kernels by batch size, so this is measured like the linear maps."""

    def __init__(self, args: ModelArgs, keys: int, device: str, quantum: int = 1) -> None:
        self.args = args
        self.quantum = quantum
        self.in_features = args.n_heads * args.head_dim
        self.input_dtype = torch.float32
        gen = torch.Generator().manual_seed(keys)
        shape = (1, args.n_kv_heads, keys, args.head_dim)
        self.keys = torch.randn(shape, generator=gen).to(device)
        self.values = torch.randn(shape, generator=gen).to(device)
        self.n_keys = keys

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        rows = x.shape[0]
        # The layouts `forward` hands over: queries (B, T, H, D) transposed, keys and
        # values (B, G, K, D) as gathered, contiguous.
        q = x.view(rows, 1, a.n_heads, a.head_dim).transpose(1, 2)
        # Each row sees the keys shifted by its own values, so rows differ.
        shift = x[:, : a.head_dim].reshape(rows, 1, 1, a.head_dim)
        keys = (self.keys + shift).contiguous()
        values = self.values.expand(rows, -1, -1, -1).contiguous()
        mask = torch.ones((rows, 1, 1, self.n_keys), dtype=torch.bool, device=x.device)
        return _attention(q, keys, values, mask, quantum=self.quantum).reshape(rows, -1)


def _torch_linears(
    gguf: GGUFFile, *, dtype: torch.dtype, device: str, weights: str
) -> Callable[..., Linear]:
    """How the torch path holds a stack of the file's matrices: Q4_0/Q4_1/Q4_K in the int4
    kernel's blocks (weights="int4", CPU only), every other type dequantized to `dtype`."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}")
    use_int4 = weights == "int4" and device == "cpu"

    def linear(*names: str) -> Linear:
        """The matrices stacked along their outputs, as one Linear."""
        blocks = [gguf.int4_blocks(n) for n in names] if use_int4 else [None]
        if all(b is not None for b in blocks) and all(
            int(b[0].shape[1]) % (_GROUP * 2) == 0 for b in blocks if b is not None
        ):
            q, scale, zero = (torch.cat([b[i] for b in blocks if b is not None]) for i in range(3))
            return Int4(q, scale, zero)
        tensors = [gguf.tensor(n, dtype).to(device) for n in names]
        return Dense(torch.cat(tensors) if len(tensors) > 1 else tensors[0])

    return linear


def load_transformer(
    gguf: GGUFFile,
    *,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    weights: str = "int4",
    native: bool = False,
    arena: PackArena | None = None,
) -> Transformer:
    """Build the model from a GGUF file: fuse QKV and gate/up, tie the head.

    `native`: every matrix packed from the file's blocks for ninfer's native kernels
    (`_native`), in `arena`'s memory (a fresh one where None; a kept pack's map gives
    them packed already), and the layers run there (the library must be loaded and
    configured).
    Else the torch path: with weights="int4" (CPU only), Q4_0/Q4_1/Q4_K matrices stay in
    their 4-bit blocks and run through torch's int4 kernel; every other tensor is
    dequantized to `dtype`. The rotary tables cover `max_positions`, never more than the
    model's context (no request goes beyond it: a table of 2^20 positions was 256 MB for
    SmolLM2, 2 GB for Gemma 3)."""
    a = gguf.args
    max_positions = min(max_positions, a.context_length)

    def norm(name: str) -> torch.Tensor:
        return gguf.tensor(name, torch.float32).to(dtype).to(device)

    linear: Callable[..., Linear]
    arena = (arena if arena is not None else PackArena()) if native else None
    if arena is not None:
        linear = lambda *names: pack_tensors(gguf, names, arena)  # noqa: E731
    else:
        linear = _torch_linears(gguf, dtype=dtype, device=device, weights=weights)

    layers = []
    for i in range(a.n_layers):
        p = f"blk.{i}."
        wqkv = linear(*(p + n for n in LAYER_TENSORS["wqkv"]))
        assert (wqkv.in_features, _out(wqkv)) == (a.dim, a.n_heads * a.head_dim + 2 * a.kv_dim)
        gate_up = linear(*(p + n for n in LAYER_TENSORS["w_gate_up"]))
        assert (gate_up.in_features, _out(gate_up)) == (a.dim, 2 * a.ffn_dim)
        bias = None
        if a.qkv_bias:
            names = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
            bias = torch.cat([norm(p + n) for n in names])
        layers.append(
            Layer(
                attn_norm=norm(p + "attn_norm.weight"),
                wqkv=wqkv,
                wo=linear(*(p + n for n in LAYER_TENSORS["wo"])),
                ffn_norm=norm(p + "ffn_norm.weight"),
                w_gate_up=gate_up,
                w_down=linear(*(p + n for n in LAYER_TENSORS["w_down"])),
                qkv_bias=bias,
                q_norm=norm(p + "attn_q_norm.weight") if a.qk_norm else None,
                k_norm=norm(p + "attn_k_norm.weight") if a.qk_norm else None,
                post_attn_norm=norm(p + "post_attention_norm.weight") if a.post_norms else None,
                post_ffn_norm=norm(p + "post_ffw_norm.weight") if a.post_norms else None,
                local=a.is_local(i),
            )
        )
    embedding, lm_head = _embedding_and_head(gguf, dtype=dtype, device=device, arena=arena)
    rope_freqs = (
        gguf.tensor("rope_freqs.weight", torch.float32).reshape(-1)
        if gguf.has_tensor("rope_freqs.weight")
        else None
    )
    model = Transformer(
        args=a,
        embedding=embedding,
        layers=layers,
        norm=norm("output_norm.weight"),
        lm_head=lm_head,
        rope=Rotations(a, max_positions, device, rope_freqs, scale=a.rope_scale),
        rope_local=Rotations(a, max_positions, device, base=a.local_rope_base)
        if a.sliding_window > 0
        else None,
        dtype=dtype,
        device=device,
        packed=not native and weights == "int4" and device == "cpu",
        attn_quantum=attention_row_quantum(a.head_dim, device=device) or _MAX_QUANTUM,
    )
    if native:
        model.native = NativeLayers(a, layers)
    return model


def _embedding_and_head(
    gguf: GGUFFile, *, dtype: torch.dtype, device: str, arena: PackArena | None
) -> tuple[Embedding, Linear]:
    """The token embedding and the output head (tied to it when the file has no
    output.weight). Natively the head is packed from the file's blocks and a tied
    embedding reads its rows from there; on the torch path the head is dense in `dtype`,
    never the int4 kernel nor bfloat16: both return their products rounded to bfloat16,
    8 significant bits, so logits near 25 land on steps of 0.125 and two candidates
    closer than that tie. SmolLM2's answer to the README's question is such a near tie
    (" The" ahead of "L" by 0.08 in float64), and on AVX2 CPUs the bfloat16 head rounded
    both to 25.25; argmax took the lower id and the model answered in French (issue 27)."""
    a = gguf.args
    tied = not gguf.has_tensor("output.weight")
    kind = gguf.tensors["token_embd.weight"].tensor_type.name
    lm_head: Linear
    if arena is not None:  # native
        head = "output.weight" if not tied else "token_embd.weight"
        lm_head = pack_tensors(gguf, [head], arena)
        if tied:
            assert isinstance(lm_head, Packed)
            embedding = Embedding(kind, None, a.dim, dtype, packed=lm_head)
        else:
            embedding = Embedding(kind, gguf.rows("token_embd.weight")[1], a.dim, dtype)
    else:
        embedding = Embedding(kind, gguf.rows("token_embd.weight")[1], a.dim, dtype)
        if tied:
            lm_head = Dense(embedding.table(dtype, device))
        else:
            lm_head = Dense(gguf.tensor("output.weight", dtype).to(device))
    assert embedding.shape == (a.vocab_size, a.dim), embedding.shape
    return embedding, lm_head


def _out(linear: Linear) -> int:
    if isinstance(linear, (Int4, Packed)):
        return linear.out_features
    return int(linear.weight.shape[0])
