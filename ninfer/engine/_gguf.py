"""Reading llama-architecture GGUF files into torch tensors.

The `gguf` package (maintained with llama.cpp) parses the container; this module
checks that the file describes a model ninfer can run, reads its hyperparameters,
and dequantizes the tensor blocks with torch ops (much faster than the numpy
dequantizer). Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (each checked bit for bit against the `gguf`
package's reference dequantizer).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from ninfer.engine._errors import ArtifactError
from ninfer.engine._kept import keep_file, mark_used

__all__ = ["GGUFFile", "ModelArgs", "decode_blocks", "dequantize", "file_sha256", "open_gguf"]

# The llama family as ninfer runs it: llama (Llama 2/3, SmolLM2; rope scaling as the
# file's rope_freqs factors), qwen2 (QKV biases) and qwen3 (RMS norms on each query and
# key head). Qwen rotates the halves of each head (NEOX order); llama files store Q/K
# permuted for rotating adjacent pairs.
SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "gemma3"})
_NEOX_ROPE = frozenset({"qwen2", "qwen3", "gemma3"})
# Gemma 3 (llama.cpp's reading of it; the GGUF converter has already added the +1 of
# Gemma's RMSNorm to every norm weight): embeddings scaled by sqrt(dim), a norm after
# attention and after the feed-forward as well as before, GELU (tanh) gating, QK-norm,
# and five sliding-window layers (rope base 10,000) for each global one (the file's base).
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
SUPPORTED_TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)  # fmt: skip

_QK = 32  # elements per quantization block for Q8_0, Q4_0 and Q4_1
_QK_K = 256  # elements per super-block of the K-quants
# Bytes per block of each K-quant (llama.cpp's block_q*_K structs).
_K_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


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
    rope_neox: bool = False  # rotate (i, i + D/2) pairs rather than adjacent (2i, 2i + 1)
    qkv_bias: bool = False  # qwen2: biases on the Q, K and V projections
    qk_norm: bool = False  # qwen3, gemma3: an RMS norm on each query and key head before rotation
    # gemma3 (defaults: the llama family's plain block)
    embed_scale: float = 1.0  # embeddings multiplied by this (sqrt(dim) for Gemma)
    post_norms: bool = False  # RMS norms on the attention and feed-forward outputs too
    gelu: bool = False  # the gate through GELU (tanh approximation) instead of SiLU
    attn_scale: float | None = None  # query scaling; None: head_dim ** -0.5
    rope_scale: float = 1.0  # linear rope scaling of the global layers: positions / this
    sliding_window: int = 0  # keys a local layer sees (0: every layer is global)
    swa_pattern: int = 0  # layer i is local iff i % swa_pattern < swa_pattern - 1
    local_rope_base: float = 10000.0  # the rope base of local layers
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) when > 0
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) when > 0

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends to a sliding window rather than the whole row."""
        p = self.swa_pattern
        return self.sliding_window > 0 and p > 0 and layer % p < p - 1

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

    def _bytes(self, name: str) -> tuple[str, np.ndarray]:
        """A matrix's type name and its stored bytes, (rows, bytes per row) uint8: a view
        of the mapped file (no copy where the tensor is contiguous, as a file's are)."""
        t = self.tensors[name]
        rows = int(np.prod([int(d) for d in t.shape.tolist()[1:]]))
        return t.tensor_type.name, np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)

    def rows(self, name: str) -> tuple[str, torch.Tensor]:
        """A matrix as it is stored: its type name and its bytes, (rows, bytes per row)
        uint8; a row is whole blocks, so `decode_blocks` reads any gathered rows."""
        kind, data = self._bytes(name)
        return kind, torch.from_numpy(data.copy())

    def stored(self, name: str) -> tuple[str, torch.Tensor]:
        """`rows` without the copy: a read-only view of the mapped file, for a reader that
        is done with it before the file is closed (packing: copying each matrix first
        was a quarter of its time). Never written to."""
        kind, data = self._bytes(name)
        with warnings.catch_warnings():  # torch warns of a view it could write to
            warnings.simplefilter("ignore", UserWarning)
            return kind, torch.from_numpy(data)

    def rows_at(self, name: str, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Rows `ids` of a matrix as `rows` gives them, read without copying the rest."""
        kind, data = self._bytes(name)
        return kind, torch.from_numpy(data[ids.numpy()])  # fancy indexing copies

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def int4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_0/Q4_1/Q4_K tensor as (q, scale, zero) with value = (q - 8) * scale + zero:
        q (rows, cols) int32 in 0..15, scale and zero (rows, cols/32) float32. None for
        other tensor types."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q4_K"):
            return None
        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())
        if kind == "Q4_K":
            # Each 32-element sub-block is q * scale - offset with q in 0..15: the int4
            # kernel's (q - 8) * scale + zero, exactly, with zero = 8 * scale - offset.
            q4, scale, offset = _q4k_parts(raw.view(-1, _K_BLOCK_BYTES["Q4_K"]))
            groups = cols // _QK
            return (
                q4.to(torch.int32).reshape(rows, cols),
                scale.reshape(rows, groups),
                (8.0 * scale - offset).reshape(rows, groups),
            )
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


# Digests remembered (`file_sha256`), the most recently used.
KEPT_DIGESTS = 256
# A file modified or changed this recently (seconds) may still be being written, within
# its times' granularity: its digest is not remembered (git's "racy" files).
RACY_S = 2.0


def file_sha256(path: str | os.PathLike[str], memo: str | os.PathLike[str] | None = None) -> str:
    """The file's sha256, hashed from a map of it in one call: hashlib holds no GIL while
    it hashes, so a thread beside it (the tokenizer's Python) does not slow it. Read 1 MiB
    at a time, each read and each update had to take the GIL back, and beside the
    tokenizer the 1B's 768 MiB took 3.4 s instead of 0.8.

    With `memo` (a directory), the digest is remembered under the file's identity: its
    real path, device, inode, size, and modification and change times in nanoseconds
    (any write to the file changes its change time, which no call can set back), and a
    file of the same identity is not hashed again (a 1.7B model's 1 GB took 0.9 s of each
    start; git's index trusts the same fields). A file changed in the last RACY_S seconds
    is hashed but not remembered."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        remembered = None
        if memo is not None:
            who = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                   st.st_ctime_ns)  # fmt: skip
            remembered = Path(memo) / (
                hashlib.sha256(repr(who).encode()).hexdigest()[:32] + ".sha256"
            )
            with contextlib.suppress(OSError, UnicodeDecodeError):
                known = remembered.read_text(encoding="ascii").strip()
                if re.fullmatch(r"[0-9a-f]{64}", known):
                    mark_used(remembered)
                    return known
        h = hashlib.sha256()
        if st.st_size > 0:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                h.update(view)
    digest = h.hexdigest()
    if remembered is not None and time.time() - max(st.st_mtime, st.st_ctime) >= RACY_S:
        with contextlib.suppress(OSError):  # not kept: the next start hashes again
            keep_file(remembered, f"{digest}\n".encode(), keep=KEPT_DIGESTS)
    return digest


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file, refusing what ninfer cannot run with an error that names it."""
    from ninfer.engine._gguf_reader import read_gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"model file not found: {path}")
    try:
        metadata, table = read_gguf(path)
    except Exception as exc:  # ValueError, struct.error, IndexError... on a bad file
        raise ArtifactError(
            f"not a readable GGUF file ({type(exc).__name__}: {exc}); is it truncated or corrupted?"
        ) from exc
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(
            f"unsupported model architecture {arch!r}; ninfer runs: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    tensors = {t.name: t for t in table}
    for t in table:
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
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        n_layers = int(need("block_count"))
        scaling = md.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ArtifactError(f"unsupported rope scaling {scaling!r} for {arch}")
        gemma = {
            "embed_scale": float(dim) ** 0.5,
            "post_norms": True,
            "gelu": True,
            # llama.cpp: Gemma 3 27B (62 layers) scales queries by its dim / heads.
            "attn_scale": (dim / n_heads) ** -0.5 if n_layers == 62 else head_dim**-0.5,
            "rope_scale": float(md.get(f"{arch}.rope.scaling.factor", 1.0))
            if scaling == "linear"
            else 1.0,
            "sliding_window": int(md.get(f"{arch}.attention.sliding_window", 0)),
            "swa_pattern": _GEMMA3_SWA_PATTERN,
            "local_rope_base": _GEMMA3_LOCAL_ROPE_BASE,
        }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if md.get(f"{arch}.{key}"):
            gemma[key.split("_")[0] + "_softcap"] = float(md[f"{arch}.{key}"])
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
        rope_neox=arch in _NEOX_ROPE,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **gemma,
    )


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of each block row, read as one float16 scale -> (N, 1) fp32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed bytes -> (N, 32) values 0..15: low nibbles are elements 0-15, high 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).to(torch.float32)


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 32) packed bytes -> (..., 2, 32): low nibbles, then high nibbles."""
    return (qs.unsqueeze(-2) >> _shifts(0, 4).view(2, 1)) & 0x0F


def _q4k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in a Q4_K/Q5_K block's 12 bytes, as float32
    (N, 8) each."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K block's 4-bit values (N, 8, 32) and each 32-value sub-block's scale and
    offset (N, 8): a value is q * scale - offset."""
    d, dmin = _f16_column(b, 0), _f16_column(b, 2)
    sc, mn = _q4k_scale_min(b[:, 4:16])
    q = _split_nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return q, d * sc, dmin * mn


def _dequantize_k(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """The K-quants, in the same operations and order as the `gguf` package's numpy
    dequantizers (so the float32 results are equal bit for bit)."""
    b = raw.view(-1, _K_BLOCK_BYTES[kind])
    n = b.shape[0]
    if kind == "Q2_K":
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16_column(b, 80), _f16_column(b, 82)
        dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
        q = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6).view(1, 1, 4, 1)) & 3
        return dl * q.reshape(n, 16, 16).to(torch.float32) - ml
    if kind == "Q3_K":
        hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
        d = _f16_column(b, 108)
        low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4).view(1, 2, 1)).reshape(n, 16)
        high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6).view(1, 4, 1)).reshape(n, 16)
        sc = (low & 0x0F) | ((high & 0x03) << 4)
        dl = (d * (sc.to(torch.int8) - 32).to(torch.float32)).reshape(n, 16, 1)
        ql = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6).view(1, 1, 4, 1)).reshape(n, 16, 16)
        qh = (hmask.reshape(n, -1, 1, 32) >> _shifts(*range(8)).view(1, 1, 8, 1)).reshape(n, 16, 16)
        q = (ql & 3).to(torch.int8) - (((qh & 1) ^ 1) << 2).to(torch.int8)
        return dl * q.to(torch.float32)
    if kind == "Q4_K":
        q, scale, offset = _q4k_parts(b)
        return scale.unsqueeze(-1) * q.to(torch.float32) - offset.unsqueeze(-1)
    if kind == "Q5_K":
        d, dmin = _f16_column(b, 0), _f16_column(b, 2)
        sc, mn = _q4k_scale_min(b[:, 4:16])
        qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(*range(8)).view(8, 1)) & 1
        ql = _split_nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
        q = ql | (qh << 4)
        return (d * sc).unsqueeze(-1) * q.to(torch.float32) - (dmin * mn).unsqueeze(-1)
    # Q6_K
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16_column(b, 208)
    dl = (d * scales.contiguous().view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = _split_nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).view(1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return dl * q.reshape(n, 16, 16).to(torch.float32)


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
    out = decode_blocks(type_name, raw, t.name).reshape(-1)
    if out.numel() != n:
        raise ArtifactError(
            f"tensor {t.name} holds {out.numel()} values, expected {n}: file truncated?"
        )
    # Always a private copy: never a view of the read-only memory map.
    return out.reshape(shape).to(dtype, copy=True).contiguous()


def decode_blocks(type_name: str, raw: torch.Tensor, name: str = "?") -> torch.Tensor:
    """The values of whole blocks of `type_name` held in the bytes `raw` (uint8), in
    their stored order (a view of `raw` for the float types)."""
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
    elif type_name in ("Q5_0", "Q5_1"):
        head = 2 if type_name == "Q5_0" else 4  # f16 scale (and f16 min for Q5_1)
        blocks = raw.view(-1, head + 4 + _QK // 2)  # then 32 high bits, 16 packed bytes
        d = _f16_column(blocks, 0)
        high_bits = blocks[:, head : head + 4].contiguous().view(torch.int32)  # little-endian
        qh = ((high_bits >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
        ql = _split_nibbles(blocks[:, head + 4 :]).reshape(-1, _QK)
        q = ql | (qh << 4)
        if type_name == "Q5_0":
            out = d * (q.to(torch.int8) - 16).to(torch.float32)
        else:
            out = d * q.to(torch.float32) + _f16_column(blocks, 2)
    elif type_name in _K_BLOCK_BYTES:
        out = _dequantize_k(type_name, raw)
    else:
        raise ArtifactError(f"unsupported tensor type {type_name} (tensor {name})")
    return out
