"""The model on ninfer's native kernels: matrices packed from the file's blocks, and the
layers run as one native call a forward pass.

`Packed` is a matrix as the kernels hold it (csrc/api.h): the values the GGUF file stores,
exactly, in panels of 16 outputs. `x W^T` sums each output over its inputs in order, one
fused multiply-add a term, in float32: the same numbers alone or in any batch, at any
thread count and on every CPU (the kernels have one build per instruction set, and all
compute the same bits), and closer to the float64 product of the file's values than a
float32 BLAS (5e-7 against 3e-5 on SmolLM2's head).

`NativeLayers` holds every layer's matrices and norms in the library's `Layers` class;
its `forward` runs a pass's positions through all the layers (norms, Q/K/V, rotary
positions, keys and values written to the page pool, attention over each row's own
pages, the output and feed-forward matrices) and leaves the residual stream in place.
Attention computes each query alone over the keys it sees, in key order, so a prompt's
numbers do not depend on its chunks, its batch or what was cached; the engine's
self-check compares all of it with float64 before it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ninfer.engine._gguf import GGUFFile, ModelArgs
from ninfer.engine._memory import advise_huge_pages

__all__ = [
    "NativeLayers",
    "PackArena",
    "Packed",
    "attention",
    "device_unsupported",
    "native_unsupported",
    "pack_tensors",
    "rmsnorm",
]


def _ops() -> Any:
    return torch.ops.ninfer


class Packed:
    """y = x W^T with W in the native kernels' panels (x: float32 rows; y float32)."""

    input_dtype = torch.float32

    def __init__(self, data: torch.Tensor, fmt: int, out_features: int, in_features: int,
                 kinds: tuple[str, ...]) -> None:  # fmt: skip
        self.data = data
        self.format = fmt
        self.out_features = out_features
        self.in_features = in_features
        self.kinds = kinds  # the file's tensor types it was packed from

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self(x.reshape(-1, self.in_features))
            return y.view(*x.shape[:-1], self.out_features)
        if x.dtype != torch.float32:
            x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        out: torch.Tensor = _ops().linear(x, self.data, self.format, self.out_features)
        return out

    native = __call__

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as their values: (len(ids), in_features) float32."""
        out: torch.Tensor = _ops().dequant(
            self.data, self.format, self.out_features, self.in_features, ids.reshape(-1).long()
        )
        return out

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def panels(self, count: int) -> Packed:
        """The first `count` panels (16 outputs each) as a matrix of their own, a view:
        the same kernel path on fewer outputs (how a product blocks its rows does not
        depend on its outputs: each output's sum is its own)."""
        total = -(-self.out_features // 16)
        if count >= total:
            return self
        per = self.nbytes // total
        return Packed(self.data[: count * per], self.format, count * 16, self.in_features,
                      self.kinds)  # fmt: skip


class PackArena:
    """Memory for a model's packed matrices: parts of CHUNK-byte buffers, each asking the
    system for transparent huge pages before its first store
    (`_memory.advise_huge_pages`; Linux's common "madvise" setting honours it). A decode
    step streams every packed byte, and on 4 KiB pages a 1B model's step took 43.6-43.9
    ms against 39.8-40.1 on 2 MiB ones; the matrices of a small model (most of SmolLM2's
    are under 1 MiB) only get them side by side. A matrix of half a chunk or more has a
    buffer of its own. What a chunk holds past its last matrix is never written, so never
    resident (but for the rest of a huge page the last matrix ends in). The arena
    remembers its buffers and parts, for keeping them between starts (`_packcache`,
    whose `MappedArena` gives a kept pack's parts back, `filled`)."""

    CHUNK = 64 << 20
    ALIGN = 64  # the kernels' loads want each matrix 64-byte aligned, as torch's buffers
    filled = False  # True: the parts `take` gives hold their matrices already

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._buffers: list[list[Any]] = []  # [buffer, bytes up to its last part's end]
        self._parts: list[tuple[torch.Tensor, int, int]] = []  # (buffer, offset, bytes)

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of fresh uint8 memory, 64-byte aligned."""
        if nbytes * 2 >= self.CHUNK:
            own = self._buffer(nbytes)
            self._buffers.append([own, nbytes])
            self._parts.append((own, 0, nbytes))
            return own
        if self._chunk is None or self._used + nbytes > self.CHUNK:
            self._chunk, self._used = self._buffer(self.CHUNK), 0
            self._buffers.append([self._chunk, 0])
        part = self._chunk[self._used : self._used + nbytes]
        self._parts.append((self._chunk, self._used, nbytes))
        self._buffers[-1][1] = self._used + nbytes
        self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return part

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh buffer (a pack file's arena maps a part of that file instead)."""
        return _huge(nbytes)

    def mapped_bytes(self) -> int:
        """Bytes of its matrices in a file's map (none here: fresh memory)."""
        return 0

    def buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Each buffer taken from, with the bytes of it its parts reach, in order."""
        return [(b, int(n)) for b, n in self._buffers]

    def parts(self) -> list[tuple[torch.Tensor, int, int]]:
        """Each part given, in order: its buffer, its offset there, its bytes."""
        return list(self._parts)


def _huge(nbytes: int) -> torch.Tensor:
    out = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(out)
    return out


def pack_tensors(gguf: GGUFFile, names: Sequence[str], arena: PackArena | None = None) -> Packed:
    """The file's tensors `names`, stacked along their outputs, packed as one matrix (in
    memory from `arena`, else a buffer of its own; an arena `filled` from a kept pack
    gives the matrix packed already)."""
    kinds, raws = zip(*(gguf.stored(n) for n in names), strict=True)
    shapes = [gguf.tensors[n].shape for n in names]
    k = int(shapes[0][0])  # GGUF lists a matrix's inputs first
    fmt = int(_ops().pack_format(list(kinds)))
    n = sum(int(r.shape[0]) for r in raws)
    size = int(_ops().packed_size(fmt, n, k))
    data = arena.take(size) if arena is not None else _huge(size)
    if arena is None or not arena.filled:
        _ops().pack_into(list(raws), list(kinds), k, fmt, data)
    return Packed(data, fmt, n, k, tuple(kinds))


def attention(
    q: torch.Tensor,
    kv: Any,
    layer: int,
    page_table: torch.Tensor,
    row: torch.Tensor,
    position: torch.Tensor,
    *,
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """The native layers' attention alone: queries q (N, H, D) float32 over layer
    `layer` of the page pool `kv` (keys transposed), query i seeing row[i]'s pages up to
    position[i] (and, with a window, less than `window` behind): (N, H, D)."""
    out: torch.Tensor = _ops().attention(
        q.float().contiguous(), kv.k, kv.v, kv.k_scale, kv.v_scale, layer, page_table, row,
        position, window, scale, softcap,
    )  # fmt: skip
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows x (..., dim) over their root mean square, times `weight`, on the native
    kernels (the layers' own norm): float32, x's shape."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out: torch.Tensor = _ops().rmsnorm(rows, weight, eps)
    return out.view(x.shape)


def device_unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why the native kernels cannot run on `device` in `dtype` (None: they can)."""
    if device != "cpu":
        return f"device {device} (the native kernels are CPU kernels)"
    if dtype != torch.float32:
        return f"dtype {str(dtype).removeprefix('torch.')} (the native kernels compute in float32)"
    return None


def native_unsupported(args: ModelArgs, dtype: torch.dtype, device: str) -> str | None:
    """Why the native layers cannot run this model here (None: they can)."""
    why = device_unsupported(device, dtype)
    if why is not None:
        return why
    for name, value in (("dim", args.dim), ("ffn_dim", args.ffn_dim), ("head_dim", args.head_dim)):
        if value % 16:
            return f"{name} {value} is not a multiple of 16"
    if args.head_dim > 256:
        return f"head_dim {args.head_dim} is over 256"
    return None


class NativeLayers:
    """Every layer of a model in the native library, run as one call a pass."""

    def __init__(self, args: ModelArgs, layers: Sequence[Any]) -> None:
        """`layers`: the model's `Layer`s, every matrix `Packed`."""
        scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.args = args
        # Called as each pass starts, on the calling thread, with the GIL free for the
        # whole pass after it (the engine delivers its pending events there: _engine.py).
        self.before_pass: Callable[[], None] | None = None
        self._impl = torch.classes.ninfer.Layers(
            [args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.ffn_dim,
             int(args.rope_neox), int(args.gelu), args.sliding_window],
            [args.norm_eps, scale, args.attn_softcap],
        )  # fmt: skip
        none = torch.empty(0)
        for layer in layers:
            mats = [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
            assert all(isinstance(m, Packed) for m in mats)
            optional = (layer.qkv_bias, layer.q_norm, layer.k_norm, layer.post_attn_norm,
                        layer.post_ffn_norm)  # fmt: skip
            self._impl.add_layer(
                [layer.attn_norm.float(), layer.ffn_norm.float(), *(m.data for m in mats),
                 *(none if t is None else t.float() for t in optional)],
                [*(m.format for m in mats), int(layer.local)],
            )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        rope_local: torch.Tensor,
        positions: torch.Tensor,
        write_page: torch.Tensor,
        write_offset: torch.Tensor,
        row: torch.Tensor,
        page_table: torch.Tensor,
        kv: Any,
        layers: tuple[int, int] = (0, -1),
    ) -> torch.Tensor:
        """Every layer (or `layers`: the first and how many) on x (N, dim) float32, in
        place; see `Layers::forward`."""
        if self.before_pass is not None:
            self.before_pass()
        out: torch.Tensor = self._impl.forward(
            x, rope, rope_local, positions, write_page, write_offset, row, page_table,
            kv.k, kv.v, kv.k_scale, kv.v_scale, layers[0], layers[1],
        )  # fmt: skip
        return out
