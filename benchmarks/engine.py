"""Engine micro-benchmark: load time, RSS, prefill and decode throughput per dtype.

    .venv/bin/python benchmarks/engine.py [--modes float32,bfloat16,float32+int4]
        [--model PATH|NAME]

Each dtype runs in a fresh subprocess so RSS after load is its own. Decode
throughput is measured over the window where all B requests are decoding
together (after every prefill), counting tokens the engine delivered.
Prints one table; --json prints machine-readable results too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

BATCHES = (1, 2, 4, 8, 16)
NEW_TOKENS = 64


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(model: str, mode: str, threads: int) -> dict[str, Any]:
    """`mode` is a dtype, optionally `+int4` for the int4 weight kernel."""
    dtype, _, weights = mode.partition("+")
    weights = weights or "dense"
    import torch

    from ninfer._artifacts import cache_dir, resolve_model
    from ninfer.engine import EngineConfig, Finish, GenerationRequest, RequestHandle, TokenDelta
    from ninfer.engine._engine import DTYPES, Engine
    from ninfer.engine._loader import load_model

    torch.set_num_threads(threads)
    path = str(resolve_model(model, cache_dir(None, os.environ)))

    class Sink:
        def __init__(self) -> None:
            self.cv = threading.Condition()
            self.first: dict[int, float] = {}
            self.done: dict[int, Finish] = {}
            self.stamps: list[tuple[float, int]] = []  # (time, tokens delivered)

        def deliver(self, events: list[tuple[RequestHandle, Any]]) -> None:
            now = time.perf_counter()
            with self.cv:
                n = 0
                for h, e in events:
                    if isinstance(e, TokenDelta):
                        self.first.setdefault(h.id, now)
                        n += len(e.token_ids)
                    elif isinstance(e, Finish):
                        self.done[h.id] = e
                self.stamps.append((now, n))
                self.cv.notify_all()

        def wait(self, pred: Any) -> None:
            with self.cv:
                assert self.cv.wait_for(pred, timeout=600)

    sink = Sink()
    t0 = time.perf_counter()
    holder: dict[str, Any] = {}

    def loader() -> Any:
        m = load_model(path, dtype=DTYPES[dtype], device="cpu", max_positions=8192, weights=weights)
        holder["load_s"] = time.perf_counter() - t0
        return m

    engine = Engine(
        loader,
        EngineConfig(
            max_batch=16, kv_capacity=16 * 1024, prefill_chunk=512, dtype=dtype, weights=weights
        ),
        sink,
    )
    ready = threading.Event()
    thread = threading.Thread(target=engine.run, kwargs={"on_ready": lambda _m: ready.set()})
    thread.start()
    ready.wait()
    out: dict[str, Any] = {
        "mode": mode,
        "load_s": holder["load_s"],
        "rss_mib": _rss_mib(),
        "batch_invariant": engine.served().batch_invariant,
    }

    def prompt(n: int, salt: int) -> tuple[int, ...]:
        return tuple(100 + (i * 31 + salt * 7) % 40000 for i in range(n))

    for n in (128, 512):
        rates = []
        for rep in range(3):
            h = engine.submit(GenerationRequest(f"p{n}", prompt(n, rep), 1))
            sink.wait(lambda h=h: h.id in sink.done)
            rates.append(n / sink.done[h.id].timings.prefill_s)
        out[f"prefill_{n}_tok_s"] = max(rates)

    for b in BATCHES:
        handles = [
            engine.submit(GenerationRequest(f"d{i}", prompt(8, i), NEW_TOKENS, ignore_eos=True))
            for i in range(b)
        ]
        sink.wait(lambda hs=handles: all(h.id in sink.first for h in hs))
        start = max(sink.first[h.id] for h in handles)
        sink.wait(lambda hs=handles: all(h.id in sink.done for h in hs))
        end = max(t for t, _ in sink.stamps)
        tokens = sum(n for t, n in sink.stamps if start < t <= end)
        out[f"decode_b{b}_tok_s"] = tokens / (end - start)
        sink.stamps.clear()
    engine.shutdown()
    thread.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--modes",
        default="float32,bfloat16,float32+int4",
        help="dtypes, each optionally +int4 (the int4 weight kernel)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.threads)))
        return
    results = []
    for dtype in args.modes.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", dtype, "--model", args.model,
             "--threads", str(args.threads)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cols = ["load_s", "rss_mib", "prefill_128_tok_s", "prefill_512_tok_s"] + [
        f"decode_b{b}_tok_s" for b in BATCHES
    ]
    print("| mode | batch-invariant | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in results:
        cells = " | ".join(f"{r[c]:.1f}" for c in cols)
        print(f"| {r['mode']} | {r['batch_invariant']} | {cells} |")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
