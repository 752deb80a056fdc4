"""Top-1 agreement of greedy next tokens with an exact float64 reference, per mode and CPU.

    .venv/bin/python benchmarks/agreement.py [--model NAME|PATH] [--tokens 2048]
        [--text FILE] [--modes native,int4,dense,dense-bfloat16]
        [--capabilities native,avx2,default] [--kv-dtypes float16,float32]
        [--llama-server PATH] [--json out.json]

Teacher-forced over a fixed text (by default the GPL-3 text Debian ships in
/usr/share/common-licenses, paragraphs joined, first --tokens tokens): at every
position, ninfer's argmax next token against the argmax of the float64 forward of the
file's dequantized values (`tests/reference_forward.py`: numpy and the `gguf` package,
none of ninfer's code). Each mode runs in a subprocess per CPU capability (ATen, oneDNN
and MKL held to it, as `tests/test_cpu_capabilities.py` does), computing the text in
prefill chunks of 256 as the engine does, with its KV cache stored as each of
--kv-dtypes (float16: the server's default beside float32 activations; a bfloat16 mode
stores its own dtype whatever is asked). A float16 cache is also held to the float64
forward whose keys and values are rounded to float16 as the cache stores them (the
values it computes on: a second reference row). With --llama-server (or $LLAMA_SERVER),
llama.cpp's server on the same file gives its greedy next token at every position
(`/completion`, the prompt as token ids, `n_predict` 1, temperature 0, its prompt cache
on). Positions are also split by the reference's margin between its two best tokens:
a near tie (< 0.1) is where rounding may fairly decide. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CAPABILITIES = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}  # fmt: skip
# mode: (dtype, weights on torch's kernels; "native": ninfer's native kernels, the default)
MODES = {"native": ("float32", "native"), "int4": ("float32", "int4"),
         "dense": ("float32", "dense"), "dense-bfloat16": ("bfloat16", "dense")}  # fmt: skip
NEAR_TIE = 0.1
CHUNK = 256


def text_tokens(model: str, text_file: str, n: int) -> tuple[str, list[int]]:
    """The model file and the first n tokens of the text (paragraphs joined)."""
    import torch

    from ninfer._artifacts import cache_dir, fetch
    from ninfer.engine._loader import load_model

    path = str(fetch(model, cache_dir(None, os.environ), progress=lambda _m: None))
    raw = Path(text_file).read_text(encoding="utf-8")
    text = "\n\n".join(re.sub(r"\s+", " ", p).strip() for p in raw.split("\n\n") if p.strip())
    tok = load_model(path, dtype=torch.float32, device="cpu", max_positions=64).tokenizer
    ids = tok.encode(text)
    if len(ids) < n + 1:
        sys.exit(f"the text has {len(ids)} tokens; {n + 1} are needed")
    return path, ids[: n + 1]


def reference(path: str, tokens: list[int], kv_half: bool = False) -> tuple[list[int], list[float]]:
    """The float64 reference's argmax at each position and its margin over the second
    (`kv_half`: its keys and values rounded to float16, as a float16 cache holds them)."""
    import numpy as np
    from reference_forward import reference_hidden

    hidden, head = reference_hidden(Path(path), tokens, kv_half=kv_half)
    best, margin = [], []
    for start in range(0, len(tokens), 128):
        logits = hidden[start : start + 128] @ head.T
        top2 = np.sort(np.partition(logits, -2, axis=-1)[:, -2:], axis=-1)
        best += logits.argmax(axis=-1).tolist()
        margin += (top2[:, 1] - top2[:, 0]).tolist()
    return best, margin


def ninfer_argmax(
    path: str, tokens: list[int], dtype: str, weights: str, kv_dtype: str = "auto"
) -> list[int]:
    """ninfer's argmax at each position (in this process), prefilled in chunks, with the
    KV cache stored as `kv_dtype` (--kv-dtype); weights "native": on the native kernels
    (the build torch dispatches to)."""
    import torch

    from ninfer.engine._kvpool import KVPages, pages_for
    from ninfer.engine._loader import load_model

    native = weights == "native"
    if native:
        from ninfer.engine import EngineConfig
        from ninfer.engine._runtime import start_kernels

        assert start_kernels(EngineConfig(), lambda _m: None).native
    m = load_model(path, dtype=getattr(torch, dtype), device="cpu",
                   max_positions=len(tokens) + 16, weights="int4" if native else weights,
                   native=native).transformer  # fmt: skip
    n_pages = pages_for(len(tokens), 16)
    out: list[int] = []
    with torch.inference_mode():
        kv = KVPages.allocate(m.args, n_pages=n_pages, page_size=16, dtype=m.dtype, device="cpu",
                              kv_dtype=kv_dtype, keys_transposed=native)  # fmt: skip
        kv.zero_pages(list(range(1, n_pages + 1)))
        for start in range(0, len(tokens), CHUNK):
            chunk = tokens[start : start + CHUNK]
            end = start + len(chunk)
            logits = m.forward(
                torch.tensor([chunk]),
                torch.arange(start, end).view(1, -1),
                torch.tensor([list(range(1, pages_for(end, 16) + 1))]),
                kv,
                last_only=False,
            )
            out += logits[0].argmax(dim=-1).tolist()
    return out


def llama_argmax(binary: str, path: str, tokens: list[int], port: int = 18099) -> list[int]:
    """llama-server's greedy next token after every prefix of `tokens`."""
    import httpx

    cmd = [binary, "-m", path, "--port", str(port), "-t", "2", "-c", str(len(tokens) + 64),
           "--no-repack", "-np", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            for _ in range(600):
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            out = []
            for i in range(1, len(tokens) + 1):
                body = {"prompt": tokens[:i], "n_predict": 1, "temperature": 0,
                        "cache_prompt": True, "return_tokens": True}  # fmt: skip
                answer = c.post("/completion", json=body).json()
                out.append(int(answer["tokens"][0]))
                if i % 256 == 0:
                    print(f"  llama-server: {i}/{len(tokens)}", file=sys.stderr)
            return out
    finally:
        proc.terminate()
        proc.wait(30)


def _agreement(pred: list[int], best: list[int], margin: list[float]) -> dict[str, Any]:
    same = [p == b for p, b in zip(pred, best, strict=True)]
    clear = [s for s, m in zip(same, margin, strict=True) if m >= NEAR_TIE]
    ties = [s for s, m in zip(same, margin, strict=True) if m < NEAR_TIE]
    return {
        "agree": sum(same) / len(same),
        "agree_clear": sum(clear) / max(len(clear), 1),
        "agree_near_tie": sum(ties) / max(len(ties), 1),
        "positions": len(same),
        "near_ties": len(ties),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # one mode under one capability
        path, dtype, weights, tokens_file, kv_dtype = sys.argv[2:7]
        tokens = json.loads(Path(tokens_file).read_text())
        print(json.dumps(ninfer_argmax(path, tokens, dtype, weights, kv_dtype)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--modes", default="native,int4,dense,dense-bfloat16")
    ap.add_argument("--capabilities", default="native,avx2,default")
    ap.add_argument("--kv-dtypes", default="float16,float32")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path, ids = text_tokens(args.model, args.text, args.tokens)
    tokens = ids[:-1]  # position i predicts ids[i + 1]
    t0 = time.perf_counter()
    best, margin = reference(path, tokens)
    ties = sum(m < NEAR_TIE for m in margin)
    took = time.perf_counter() - t0
    print(f"float64 reference: {len(tokens)} positions in {took:.0f} s, {ties} near ties",
          file=sys.stderr)  # fmt: skip
    halves = reference(path, tokens, kv_half=True) if "float16" in args.kv_dtypes else None
    tokens_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"agreement-{os.getpid()}.json"
    tokens_file.write_text(json.dumps(tokens))
    rows: list[dict[str, Any]] = []
    for cap in args.capabilities.split(","):
        for mode in args.modes.split(","):
            dtype, weights = MODES[mode]
            kv_dtypes = args.kv_dtypes.split(",") if dtype == "float32" else ["auto"]
            for kv_dtype in kv_dtypes:
                t0 = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, __file__, "--child", path, dtype, weights,
                     str(tokens_file), kv_dtype],
                    env={**os.environ, **CAPABILITIES[cap]}, capture_output=True, text=True,
                    check=True,
                )  # fmt: skip
                pred = json.loads(done.stdout.strip().splitlines()[-1])
                kv = dtype if kv_dtype == "auto" else kv_dtype
                rows.append({"who": "ninfer", "mode": mode, "kv": kv, "capability": cap,
                             "reference": "float64",
                             "seconds": round(time.perf_counter() - t0, 1),
                             **_agreement(pred, best, margin)})  # fmt: skip
                print(f"  {mode} / {kv} / {cap}: {rows[-1]['agree']:.4f}", file=sys.stderr)
                if kv == "float16" and halves is not None:
                    rows.append({**rows[-1], "reference": "float64, keys and values as halves",
                                 **_agreement(pred, *halves)})  # fmt: skip
    binary = args.llama_server or shutil.which("llama-server")
    if binary:
        pred = llama_argmax(binary, path, tokens)
        rows.append({"who": "llama-server", "mode": "its own (q8 activations)", "kv": "float16",
                     "capability": "native", "reference": "float64",
                     **_agreement(pred, best, margin)})  # fmt: skip
    tokens_file.unlink()
    print(
        f"\nTop-1 agreement with the float64 reference, {len(tokens)} positions of "
        f"{Path(args.text).name} ({sum(m < NEAR_TIE for m in margin)} near ties):"
    )
    print(
        "| server | mode | KV cache | CPU | reference | all | clear (margin >= 0.1) | near ties |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['who']} | {r['mode']} | {r['kv']} | {r['capability']} | {r['reference']} | "
              f"{r['agree']:.2%} | "
              f"{r['agree_clear']:.2%} | {r['agree_near_tie']:.2%} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
