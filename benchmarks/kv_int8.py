"""--kv-dtype int8 against the float32 KV cache: memory, agreement, speed.

    .venv/bin/python benchmarks/kv_int8.py [--tokens 2048] [--text FILE]
        [--clients 1,8,16] [--duration-s 20] [--max-tokens 64] [--json out.json]

- Memory: bytes a token's keys and values take (every layer), and the tokens a pool
  of the default float32 size (--max-context tokens) holds instead.
- Agreement: teacher-forced over a fixed text (GPL-3 as Debian ships it, the first
  --tokens tokens, prefilled in chunks of 256 as the engine does), the argmax next token
  at every position with the int8 cache against the float32 cache, and each against the
  float64 reference of the file's values (benchmarks/agreement.py).
- Speed: two servers on SmolLM2 (float32 and int8 KV), started together, loaded one
  level at a time in turn with `ninfer bench`'s closed loop (chat, ignore_eos), so
  their figures come from the same minutes of this shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from agreement import NEAR_TIE, ninfer_argmax, reference, text_tokens  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(kv_dtype: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [str(ROOT / ".venv/bin/ninfer"), "serve", "--port", str(port), "--kv-dtype", kv_dtype,
           "--max-concurrency", "16", "--max-pending-requests", "64", "--served-model-name", "m",
           "--log-stats-interval-ms", "0", "--no-access-log"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ready(port: int) -> None:
    import httpx

    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server on {port} never became ready")


def speed(clients: list[int], duration_s: float, max_tokens: int) -> list[dict[str, Any]]:
    import trio

    from ninfer.tools._bench import BenchConfig, run_bench

    ports = {"float32": _free_port(), "int8": _free_port()}
    procs = {kind: _serve(kind, port)
             for kind, port in ports.items()}  # fmt: skip
    rows = []
    try:
        for port in ports.values():
            _ready(port)
        for n in clients:
            for kind, port in ports.items():
                cfg = BenchConfig(
                    url=f"http://127.0.0.1:{port}", model="m", clients=(n,),
                    duration_s=duration_s, max_tokens=max_tokens, warmup_s=2.0,
                )  # fmt: skip
                (level,) = trio.run(lambda cfg=cfg: run_bench(cfg, progress=False))
                s = level.summary()
                rows.append({"kv": kind, "clients": n, "tok_s": s["tokens_per_second"],
                             "itl_p50_ms": (s["itl_p50"] or 0) * 1000,
                             "ttft_p50_ms": (s["ttft_p50"] or 0) * 1000})  # fmt: skip
                print(f"  {kind} x{n}: {s['tokens_per_second']:.1f} tok/s", file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(60)
    return rows


def _agree(pred: list[int], best: list[int]) -> float:
    return sum(p == b for p, b in zip(pred, best, strict=True)) / len(best)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # one cache kind, its own process
        path, kv_dtype, tokens_file = sys.argv[2:5]
        tokens = json.loads(Path(tokens_file).read_text())
        print(json.dumps(ninfer_argmax(path, tokens, "float32", "int4", kv_dtype)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from ninfer.engine._kvpool import KVPages
    from ninfer.engine._loader import load_model

    path, ids = text_tokens(args.model, args.text, args.tokens)
    tokens = ids[:-1]
    model = load_model(path, dtype=torch.float32, device="cpu", max_positions=64)
    a = model.transformer.args
    per = {k: KVPages.bytes_per_token(a, torch.float32, k) for k in ("auto", "int8")}
    context = model.identity.context_length
    memory = {"float32_bytes_per_token": per["auto"], "int8_bytes_per_token": per["int8"],
              "ratio": per["auto"] / per["int8"],
              "tokens_in_a_float32_default_pool": context,
              "int8_tokens_in_the_same_memory": context * per["auto"] // per["int8"]}  # fmt: skip
    print(f"memory: {memory}", file=sys.stderr)

    best, margin = reference(path, tokens)
    tokens_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"kv-int8-{os.getpid()}.json"
    tokens_file.write_text(json.dumps(tokens))
    preds = {}
    for kind in ("auto", "int8"):
        done = subprocess.run([sys.executable, __file__, "--child", path, kind, str(tokens_file)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        preds[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    tokens_file.unlink()
    same = [x == y for x, y in zip(preds["auto"], preds["int8"], strict=True)]
    clear = [s for s, m in zip(same, margin, strict=True) if m >= NEAR_TIE]
    agreement = {
        "positions": len(same),
        "int8_vs_float32_cache": sum(same) / len(same),
        "int8_vs_float32_cache_clear": sum(clear) / max(len(clear), 1),
        "float32_cache_vs_reference": _agree(preds["auto"], best),
        "int8_cache_vs_reference": _agree(preds["int8"], best),
    }
    print(f"agreement: {agreement}", file=sys.stderr)
    rows = speed([int(c) for c in args.clients.split(",")], args.duration_s, args.max_tokens)

    print(f"\nKV cache memory: float32 {per['auto']} B/token, int8 {per['int8']} B/token "
          f"({memory['ratio']:.2f}x less; a {context}-token float32 pool's memory holds "
          f"{memory['int8_tokens_in_the_same_memory']} int8 tokens)")  # fmt: skip
    print(f"\nTop-1 agreement over {len(same)} positions of {Path(args.text).name}:")
    print("| compared | all | clear (reference margin >= 0.1) |")
    print("|---|---|---|")
    print(f"| int8 cache vs float32 cache | {agreement['int8_vs_float32_cache']:.2%} | "
          f"{agreement['int8_vs_float32_cache_clear']:.2%} |")  # fmt: skip
    print(
        f"| float32 cache vs float64 reference | {agreement['float32_cache_vs_reference']:.2%} | |"
    )
    print(f"| int8 cache vs float64 reference | {agreement['int8_cache_vs_reference']:.2%} | |")
    print("\n| clients | float32 tok/s | int8 tok/s | int8 / float32 | ITL p50 float32 / int8 ms |")
    print("|---|---|---|---|---|")
    for n in sorted({r["clients"] for r in rows}):
        f = next(r for r in rows if r["clients"] == n and r["kv"] == "float32")
        q = next(r for r in rows if r["clients"] == n and r["kv"] == "int8")
        print(f"| {n} | {f['tok_s']:.1f} | {q['tok_s']:.1f} | {q['tok_s'] / f['tok_s']:.2f}x | "
              f"{f['itl_p50_ms']:.0f} / {q['itl_p50_ms']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"memory": memory, "agreement": agreement, "speed": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
