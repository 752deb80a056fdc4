"""Write a tiny random-weight llama GGUF (byte-level BPE vocab, ChatML template), or a
Gemma 3 one (SentencePiece vocab with byte fallback, Gemma's chat template).

Used by most tests: it goes through exactly the loading path of a real model,
with every supported tensor type represented, and runs in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ninfer._chat_templates import CHATML, GEMMA3_TEMPLATE

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Gemma's first ids (pad 0, eos 1, bos 2, unk 3), then its turn markers.
SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_WORDS = ["▁the", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "ing", "▁and", "\n"]
WORDS = ["the", "and", "ing", "ion", "Ġthe", "Ġa", "Ġof", "er", "in", "Ġto", "Ġis", "ĠParis"]


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def vocab_and_merges() -> tuple[list[str], list[int], list[str]]:
    tokens = list(SPECIAL) + _bytes_to_unicode()
    types = [3] * len(SPECIAL) + [1] * 256
    merges: list[str] = []
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            merged = cur + ch
            if merged not in tokens:
                merges.append(f"{cur} {ch}")
                tokens.append(merged)
                types.append(1)
            cur = merged
    return tokens, types, merges


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """Gemma-style pieces: control tokens, the 256 byte tokens, the characters of
    SPM_WORDS and every prefix of each word, scored so that longer pieces merge later."""
    tokens = list(SPM_SPECIAL) + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(SPM_SPECIAL) + [6] * 256
    scores = [0.0] * len(tokens)
    pieces: list[str] = []
    for word in SPM_WORDS:
        pieces += [ch for ch in word if ch not in pieces]
    for word in SPM_WORDS:
        pieces += [word[:n] for n in range(2, len(word) + 1) if word[:n] not in pieces]
    for i, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    return tokens, types, scores


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    context: int = 512,
    tied: bool = True,
    architecture: str = "llama",
    embed_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
    rope_freqs: bool = False,
    head_dim: int | None = None,
    sliding_window: int = 8,
    chat_template: bool = True,
    packed_layers: bool = False,
    sampling: dict[str, float | int] | None = None,
    odd_layer: int | None = None,
) -> Path:
    """A random-weight model of the llama family. `architecture` qwen2 adds QKV biases,
    qwen3 per-head query and key norms; `rope_freqs` adds Llama 3's rope-scaling
    factors (a `rope_freqs.weight` tensor). gemma3 adds norms after attention and the
    feed-forward, QK-norms and a SentencePiece vocabulary; with 6 or more layers
    (`n_layers`) both its sliding-window (`sliding_window` keys) and global layers.
    `packed_layers`: every layer matrix in Q4_0 or Q4_1, as a Q4 model's are (all of
    them run through the int4 kernel), instead of a mix of types. `odd_layer`: that
    layer's ffn_down stored as Q8_0 (as a Q4_K_M file stores some layers' as Q6_K), the
    only matrix of its type. `sampling`: recommended
    defaults as general.sampling.<key> (floats as float32, ints as int32, as llama.cpp
    writes them; anything else as a string)."""
    rng = np.random.default_rng(seed)
    gemma = architecture == "gemma3"
    if gemma:
        tokens, types, scores = sentencepiece_vocab()
    else:
        tokens, types, merges = vocab_and_merges()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test-llama")
    for key, value in (sampling or {}).items():
        name = f"general.sampling.{key}"
        if isinstance(value, int) and not isinstance(value, bool):
            w.add_int32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_string(name, str(value))
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(1_000_000.0 if gemma else 10000.0)  # gemma3: its global layers'
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if gemma:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores(scores)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
        if chat_template:
            w.add_chat_template(GEMMA3_TEMPLATE)
        w.add_sliding_window(sliding_window)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if chat_template:  # without: a base model, as Gemma 3 270M is
            w.add_chat_template(CHATML)

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> None:
        data = (rng.standard_normal(shape) * 2.0 / np.sqrt(shape[-1])).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    T = gguf.GGMLQuantizationType
    if head_dim is None:
        head_dim = dim // n_heads
    else:  # heads wider than dim / heads (Qwen 3 does this): said in the metadata
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    # Scaled so that the tied head gives logits of order 1: varied, not degenerate, output.
    emb = (rng.standard_normal((vocab, dim)) * 0.25).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, embed_type), raw_dtype=embed_type)
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
        add(p + "attn_q.weight", (n_heads * head_dim, dim), T.Q4_1)
        add(p + "attn_k.weight", (n_kv_heads * head_dim, dim), T.Q4_0)
        add(p + "attn_v.weight", (n_kv_heads * head_dim, dim), T.Q4_1 if packed_layers else T.F16)
        add(p + "attn_output.weight", (dim, n_heads * head_dim),
            T.Q4_0 if packed_layers else T.BF16)  # fmt: skip
        add(p + "ffn_gate.weight", (ffn, dim), T.Q4_1 if packed_layers else T.Q8_0)
        add(p + "ffn_up.weight", (ffn, dim), T.Q4_1 if packed_layers else T.F32)
        add(p + "ffn_down.weight", (dim, ffn), T.Q8_0 if i == odd_layer else T.Q4_1)
        if architecture == "qwen2":
            for name, rows in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
                bias = (rng.standard_normal(rows * head_dim) * 0.5).astype(np.float32)
                w.add_tensor(f"{p}attn_{name}.bias", bias)
        if gemma:  # the converter's +1 is in the file: weights around 1
            for name in ("post_attention_norm", "post_ffw_norm"):
                norm = (1.0 + rng.standard_normal(dim) * 0.3).astype(np.float32)
                w.add_tensor(f"{p}{name}.weight", norm)
        if architecture in ("qwen3", "gemma3"):
            for name in ("q", "k"):
                norm = (1.0 + rng.standard_normal(head_dim) * 0.3).astype(np.float32)
                w.add_tensor(f"{p}attn_{name}_norm.weight", norm)
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    if rope_freqs:  # Llama 3 style: low frequencies stretched, high ones kept
        factors = np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32)
        w.add_tensor("rope_freqs.weight", factors)
    if not tied:
        add("output.weight", (vocab, dim), T.Q4_1 if packed_layers else T.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
