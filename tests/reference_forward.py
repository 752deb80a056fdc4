"""An independent float64 forward of the llama family, written from the models' published
equations with numpy and the `gguf` package's own dequantizers (none of ninfer's code):
what the engine's logits are checked against, architecture by architecture.

llama: RMSNorm, rotary embeddings on adjacent pairs (the GGUF stores Q and K rows
permuted for it) with frequencies divided by `rope_freqs` when present (Llama 3's
scaling), grouped-query causal attention, SwiGLU. qwen2: the same with biases on Q, K
and V and rotation of the two halves of each head. qwen3: qwen2 without the biases and
with an RMSNorm over each query and key head before the rotation. gemma3 (Gemma 3's
published equations; the GGUF's norm weights already hold Gemma's 1 + w): qwen3's
attention, embeddings times sqrt(dim), an RMSNorm on the attention output and on the
feed-forward output before each is added back, GELU (tanh form) instead of SiLU, and
layers i with i % 6 != 5 attending only to the `sliding_window` latest keys with rope
base 10,000 (the others: the file's base).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """float64 logits (T, vocab) of every position of `tokens`."""
    hidden, head = reference_hidden(path, tokens)
    return hidden @ head.T


def reference_hidden(
    path: Path, tokens: list[int], *, kv_half: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """float64 final hidden states (T, dim), normed, and the head (vocab, dim) they are
    multiplied by: the logits, for a caller that takes them a slice at a time.
    `kv_half`: each layer's keys (rotated) and values rounded to the nearest float16, as
    a float16 KV cache stores them, everything else float64."""
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def weight(name: str) -> np.ndarray:
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        return values.reshape([int(d) for d in reversed(t.shape.tolist())])

    def hp(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    dim, n_layers = int(hp("embedding_length")), int(hp("block_count"))
    heads = int(hp("attention.head_count"))
    kv_heads = int(hp("attention.head_count_kv", heads))
    head_dim = int(hp("attention.key_length", dim // heads))
    eps = float(hp("attention.layer_norm_rms_epsilon"))
    base = float(hp("rope.freq_base", 10000.0))

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w

    n = len(tokens)
    half = head_dim // 2
    gemma = arch == "gemma3"
    window = int(hp("attention.sliding_window", 0)) if gemma else 0

    def rotation(theta: float) -> tuple[np.ndarray, np.ndarray]:
        freqs = theta ** (-2.0 * np.arange(half) / head_dim)
        if "rope_freqs.weight" in tensors:
            freqs = freqs / weight("rope_freqs.weight").reshape(-1)
        angle = np.outer(np.arange(n), freqs)  # (T, D/2)
        return np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:  # (T, heads, D)
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    x = weight("token_embd.weight")[tokens]  # (T, dim)
    if gemma:
        x = x * np.sqrt(dim)
    causal = np.tril(np.ones((n, n), dtype=bool))
    behind = np.arange(n)[:, None] - np.arange(n)[None, :]  # query position - key position
    for i in range(n_layers):
        p = f"blk.{i}."
        local = window > 0 and i % 6 != 5
        visible = causal & (behind < window) if local else causal
        cos, sin = rotation(10000.0 if local else base)
        h = rms(x, weight(p + "attn_norm.weight"))
        qkv = []
        for name in ("q", "k", "v"):
            y = h @ weight(f"{p}attn_{name}.weight").T
            if f"{p}attn_{name}.bias" in tensors:
                y = y + weight(f"{p}attn_{name}.bias")
            qkv.append(y)
        q = qkv[0].reshape(n, heads, head_dim)
        k = qkv[1].reshape(n, kv_heads, head_dim)
        v = qkv[2].reshape(n, kv_heads, head_dim)
        if f"{p}attn_q_norm.weight" in tensors:
            q = rms(q, weight(p + "attn_q_norm.weight"))
            k = rms(k, weight(p + "attn_k_norm.weight"))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if kv_half:
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        out = np.empty((n, heads, head_dim))
        for hd in range(heads):
            g = hd // (heads // kv_heads)
            scores = q[:, hd] @ k[:, g].T / np.sqrt(head_dim)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, hd] = probs @ v[:, g]
        attn = out.reshape(n, heads * head_dim) @ weight(p + "attn_output.weight").T
        x = x + (rms(attn, weight(p + "post_attention_norm.weight")) if gemma else attn)
        h = rms(x, weight(p + "ffn_norm.weight"))
        gate, up = h @ weight(p + "ffn_gate.weight").T, h @ weight(p + "ffn_up.weight").T
        act = gelu_tanh(gate) if gemma else gate / (1.0 + np.exp(-gate))
        ffn = (act * up) @ weight(p + "ffn_down.weight").T
        x = x + (rms(ffn, weight(p + "post_ffw_norm.weight")) if gemma else ffn)
    head = weight("output.weight") if "output.weight" in tensors else weight("token_embd.weight")
    return rms(x, weight("output_norm.weight")), head
