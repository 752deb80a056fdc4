"""Measuring at start-up which batch sizes compute a row bit-identically.

A matrix multiply on CPU picks its kernel by shape. On the machine this was
written on, a float32 `linear` with the model's shapes computes a row one way
at M=1, another at M=2..3, and rows near the end of a batch differently unless M
is a multiple of 4 or at least 12. Tokens then almost never change, but "almost"
is no guarantee.

So the engine measures, on the model's own weight shapes, the set of batch
sizes whose rows are bit-identical to the same rows computed in the largest
batch (and independent of their position in it), and
pads each decode batch up to the next size in that set. If rows depend on their
position even in the largest batch, nothing can be promised and the engine says
so instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = [
    "attention_row_quantum",
    "invariant_batch_sizes",
    "prime_vector_math",
    "rows_independent_of_count",
]

# The elementwise functions torch computes through MKL's vector math (VML) that the
# engine runs (attention, soft-capping, GELU, sampling, the rotary table).
_VML_FUNCTIONS = (
    torch.exp, torch.expm1, torch.log, torch.log1p, torch.tanh, torch.erf,
    torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.sigmoid,
)  # fmt: skip


@functools.cache
def prime_vector_math() -> None:
    """Call each vector-math function once on a few elements (one thread) before any
    call large enough to be split across threads. Measured with this torch and MKL on
    two threads: the process's first `torch.exp` over a few thousand elements came out,
    in one process in five, with errors up to 1.5e-4 (MKL's lowest-accuracy mode) on
    the elements one thread computed, and exact from the second call on; a first call
    on one thread never did. The engine's self-check caught it as "attention computes
    wrong" and refused to start. Idempotent; called before a model is loaded."""
    x = torch.full((8,), 0.5)
    for fn in _VML_FUNCTIONS:
        fn(x)


# Row counts a batched matmul's rows may be padded to a multiple of (see
# `attention_row_quantum`): tile heights of the usual CPU GEMM kernels divide one.
_QUANTA = (1, 2, 4, 6, 8, 12, 16, 24, 48)


class LinearLike(Protocol):
    in_features: int
    input_dtype: torch.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def _agreeing_sizes(x: torch.Tensor, f: LinearLike) -> set[int]:
    """Row counts m at which f(x[:m]) equals the first m rows of f(x)."""
    reference = f(x)
    return {m for m in range(1, len(x) + 1) if torch.equal(f(x[:m]), reference[:m])}


def invariant_batch_sizes(
    linears: Sequence[LinearLike], *, max_rows: int, device: str = "cpu"
) -> list[int] | None:
    """Sorted batch sizes (always including max_rows) at which every row of every
    linear map equals that row in a batch of max_rows; None when rows depend on their
    position within a batch. (Attention is written so that rows never interact: see
    `_model._attention`.)"""
    gen = torch.Generator().manual_seed(1234)
    good = set(range(1, max_rows + 1))
    for f in linears:
        # Many rows and columns: a low-precision output can hide a different summation
        # order in one value by rounding, hardly in all of them.
        x = torch.randn((max_rows, f.in_features), generator=gen).to(f.input_dtype).to(device)
        good &= _agreeing_sizes(x, f)
        perm = torch.randperm(max_rows, generator=gen)
        if not torch.equal(f(x)[perm], f(x[perm])):
            return None
    good.add(max_rows)
    return sorted(good)


def rows_independent_of_count(
    linears: Sequence[LinearLike], *, max_rows: int, device: str = "cpu"
) -> bool:
    """Whether every row of every linear map is computed the same in a matmul of any
    row count up to max_rows, at any place in it: measured at sizes that cover the
    kernels' usual blockings (1 to 5, powers of two and their neighbours, max_rows)
    and two offsets. Then prompts prefilled together get the numbers each would get
    alone (torch's int4 kernel does this; its float32 and bfloat16 matmuls do not)."""
    sizes = {1, 2, 3, 4, 5, max_rows}
    for p in range(3, max_rows.bit_length()):
        sizes |= {2**p - 1, 2**p, 2**p + 1}
    gen = torch.Generator().manual_seed(4321)
    for f in linears:
        x = torch.randn((max_rows + 1, f.in_features), generator=gen).to(f.input_dtype).to(device)
        reference = f(x)
        for m in sorted(s for s in sizes if s <= max_rows):
            for start in (0, 1):
                if not torch.equal(f(x[start : start + m]), reference[start : start + m]):
                    return False
    return True


@functools.cache  # a property of the CPU and its libraries: measured once a process
def attention_row_quantum(head_dim: int, *, device: str = "cpu") -> int | None:
    """The smallest Q such that the batched matmuls attention runs (queries by one block
    of 64 keys, rows x head_dim by head_dim x 64; probabilities by that block's values,
    rows x 64 by 64 x head_dim; at least 2 in a batch) compute each row the same whenever
    the row count is a multiple of Q, for any row and batch count.

    A CPU GEMM computes rows in tiles, and rows left over in a partial tile may take
    another kernel that sums in another order (measured: MKL's AVX2 sgemm needs 12, its
    SSE4.2 one 8, its AVX-512 one 4). Attention pads its query rows to a multiple of
    Q. None: no Q tried works (the engine's self-check then finds rows that depend on
    their batch)."""
    gen = torch.Generator().manual_seed(99)
    rows, batch = 240, 5
    q = torch.randn((batch, rows, head_dim), generator=gen).to(device)
    k = torch.randn((batch, 64, head_dim), generator=gen).to(device)
    p = torch.rand((batch, rows, 64), generator=gen).to(device)
    v = torch.randn((batch, 64, head_dim), generator=gen).to(device)
    scores = torch.bmm(q, k.transpose(1, 2))
    values = torch.bmm(p, v)
    for quantum in _QUANTA:
        # Every multiple up to half the reference (a sample missed MKL's 78 rows), at
        # two batch counts; the first that differs rules the quantum out.
        if all(
            torch.equal(torch.bmm(q[:b, :m], k[:b].transpose(1, 2)), scores[:b, :m])
            and torch.equal(torch.bmm(p[:b, :m], v[:b]), values[:b, :m])
            for m in range(quantum, rows // 2 + 1, quantum)
            for b in (2, 5)
        ):
            return quantum
    return None
