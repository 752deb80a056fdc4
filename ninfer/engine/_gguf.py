"""Reading llama-architecture GGUF files into torch tensors.

The `gguf` package (maintained with llama.cpp) parses the container; this module
checks that the file describes a model ninfer can run, reads its hyperparameters,
and dequantizes the tensor blocks with torch ops (much faster than the numpy
dequantizer). Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch

from ninfer._errors import ArtifactError

__all__ = ["GGUFFile", "ModelArgs", "dequantize", "file_sha256", "open_gguf"]

SUPPORTED_ARCHITECTURES = frozenset({"llama"})
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"})

_QK = 32  # elements per quantization block for Q8_0, Q4_0 and Q4_1


@attrs.frozen
class ModelArgs:
    """The shape of a llama model, read from GGUF metadata."""

    architecture: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    norm_eps: float

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@attrs.frozen
class GGUFFile:
    """An opened GGUF file: metadata values and tensor views (memory-mapped)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor
    args: ModelArgs

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize one tensor into a fresh torch tensor of `dtype`, shape [out, in]."""
        if name not in self.tensors:
            raise ArtifactError(f"GGUF file has no tensor {name!r}")
        return dequantize(self.tensors[name], dtype)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def int4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_0/Q4_1 tensor as (q, scale, zero) with value = (q - 8) * scale + zero:
        q (rows, cols) int32 in 0..15, scale and zero (rows, cols/32) float32. None for
        other tensor types."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            return None
        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())
        head = 2 if kind == "Q4_0" else 4
        blocks = raw.view(-1, head + _QK // 2)
        d = _f16_column(blocks, 0)
        qs = blocks[:, head:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1).to(torch.int32)  # (blocks, 32)
        zero = torch.zeros_like(d) if kind == "Q4_0" else _f16_column(blocks, 2) + 8.0 * d
        groups = cols // _QK
        return (
            q.reshape(rows, cols),
            d.reshape(rows, groups),
            zero.reshape(rows, groups),
        )


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _iter_metadata(reader: Any) -> Iterator[tuple[str, Any]]:
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        yield key, field.contents()


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file, refusing what ninfer cannot run with an error that names it."""
    from gguf import GGUFReader  # imported here: it pulls numpy-heavy modules

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"model file not found: {path}")
    try:
        # Copy-on-write map: the arrays are writable for torch, the file is never written.
        reader = GGUFReader(path, "c")
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError...
        raise ArtifactError(
            f"not a readable GGUF file ({type(exc).__name__}: {exc}); is it truncated or corrupted?"
        ) from exc
    metadata = dict(_iter_metadata(reader))
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(
            f"unsupported model architecture {arch!r}; ninfer runs: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ArtifactError(
                f"unsupported tensor type {type_name} (tensor {t.name}); ninfer reads: "
                + ", ".join(sorted(SUPPORTED_TENSOR_TYPES))
            )
    args = _model_args(metadata, tensors)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, args=args)


def _model_args(md: dict[str, Any], tensors: dict[str, Any]) -> ModelArgs:
    arch = md["general.architecture"]

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ArtifactError(f"GGUF metadata lacks {full}")
        return md[full]

    dim = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
    if dim % n_heads or n_heads % n_kv_heads:
        raise ArtifactError(f"inconsistent head counts: dim {dim}, heads {n_heads}/{n_kv_heads}")
    head_dim = int(md.get(f"{arch}.attention.key_length", dim // n_heads))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise ArtifactError("GGUF metadata gives no vocabulary size")
    if "token_embd.weight" not in tensors:
        raise ArtifactError("GGUF file has no token_embd.weight tensor")
    return ModelArgs(
        architecture=arch,
        n_layers=int(need("block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")),
        vocab_size=vocab,
        context_length=int(need("context_length")),
        rope_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
    )


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of each block row, read as one float16 scale -> (N, 1) fp32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed bytes -> (N, 32) values 0..15: low nibbles are elements 0-15, high 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).to(torch.float32)


def dequantize(t: Any, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize a gguf ReaderTensor into torch `dtype` with shape [rows, cols] (or [n])."""
    type_name = t.tensor_type.name
    # GGUF lists dims innermost first; torch order is the reverse.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    n = int(t.n_elements)
    data = np.ascontiguousarray(t.data)
    if not data.flags.writeable:  # a read-only map: torch wants writable memory
        data = data.copy()
    raw = torch.from_numpy(data.view(np.uint8).reshape(-1))
    if type_name == "F32":
        out = raw.view(torch.float32)
    elif type_name == "F16":
        out = raw.view(torch.float16)
    elif type_name == "BF16":
        out = raw.view(torch.bfloat16)
    elif type_name == "Q8_0":
        blocks = raw.view(-1, 2 + _QK)  # (N, 34): f16 scale, 32 int8
        d = _f16_column(blocks, 0)
        q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
        out = q * d
    elif type_name == "Q4_0":
        blocks = raw.view(-1, 2 + _QK // 2)  # (N, 18): f16 scale, 16 packed bytes
        d = _f16_column(blocks, 0)
        out = (_unpack_nibbles(blocks[:, 2:]) - 8.0) * d
    elif type_name == "Q4_1":
        blocks = raw.view(-1, 4 + _QK // 2)  # (N, 20): f16 scale, f16 min, 16 packed bytes
        d = _f16_column(blocks, 0)
        m = _f16_column(blocks, 2)
        out = _unpack_nibbles(blocks[:, 4:]) * d + m
    else:
        raise ArtifactError(f"unsupported tensor type {type_name} (tensor {t.name})")
    out = out.reshape(-1)
    if out.numel() != n:
        raise ArtifactError(
            f"tensor {t.name} holds {out.numel()} values, expected {n}: file truncated?"
        )
    # Always a private copy: never a view of the read-only memory map.
    return out.reshape(shape).to(dtype, copy=True).contiguous()
