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

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["invariant_batch_sizes"]


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
