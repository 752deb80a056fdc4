"""Where one decode step goes: torch calls and time per op, on the real model.

    .venv/bin/python benchmarks/step_profile.py [--model NAME|PATH] [--rows 1,16]
        [--context 100] [--threads 2] [--steps 20] [--top 14] [--kernels native|torch]
        [--kv-dtype float16|float32|int8]

Runs `Transformer.forward` on a fixed decode batch (`rows` rows of one new token each,
`context` tokens of keys, pages spread over a pool as a server's are), outside the
server. Prints, per batch size: the step time (minimum over repeats of 5 steps), the
number of top-level torch calls a step (exact: the figure to compare between
versions), and the ops that take the most time under `torch.profiler` (which inflates
small ops; read the counts and the share, not the absolute times). With it, the bytes a
step reads from memory (every matrix the step multiplies by, as the kernels store it,
and the rows' keys and values at --context in the --kv-dtype pool: the server's
default, float16, unless named) and that over the step time, against the bandwidth
this machine reads at (`torch.sum` over 1 GiB on --threads threads, best of 5, measured
first). To compare two versions, run it from each checkout. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model
from ninfer.engine._kernels import build_kernels, load_kernels, torch_isa
from ninfer.engine._kvpool import KVPages
from ninfer.engine._loader import load_model
from ninfer.engine._model import Transformer
from ninfer.engine._native import Packed

PAGE = 16


def read_bandwidth(threads: int) -> float:
    """Bytes a second this machine reads: torch.sum over 1 GiB of float32 on `threads`
    threads, the best of 5 (the first pass touches the pages)."""
    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def matrix_bytes(model: Transformer) -> int:
    """Bytes of every matrix a decode step multiplies by, as stored for the kernels (the
    packed panels natively; torch's own tensors otherwise)."""
    total = 0
    for m in model.linears():
        if isinstance(m, Packed):
            total += m.nbytes
        else:
            total += sum(t.numel() * t.element_size() for t in vars(m).values()
                         if isinstance(t, torch.Tensor))  # fmt: skip
    return total


def profile_rows(
    model: Transformer, kv: KVPages, rows: int, args: argparse.Namespace, bandwidth: float
) -> None:
    pages = args.context // PAGE + 1
    # Each row's pages scattered over the pool, as a busy server's are.
    table = torch.tensor(
        [[1 + (b * pages + p) * 7919 % kv.n_pages for p in range(pages)] for b in range(rows)]
    )
    tokens = torch.full((rows, 1), 42)
    positions = torch.full((rows, 1), args.context)

    def step() -> None:
        model.forward(tokens, positions, table, kv, last_only=True)

    with torch.inference_mode():
        for _ in range(5):
            step()
        best = float("inf")
        for _ in range(args.steps):
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            best = min(best, (time.perf_counter() - t0) / 5)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    top_level = [e for e in prof.events() if e.cpu_parent is None]
    # The time of everything under each top-level op, by that op's name.
    spent: dict[str, float] = defaultdict(float)
    for e in top_level:
        spent[e.name] += e.cpu_time_total
    calls = Counter(e.name for e in top_level)
    total = sum(spent.values())
    print(f"\n{rows} row(s), {args.context} tokens of context, {args.threads} threads:")
    print(f"  step {best * 1e3:.2f} ms (minimum of {args.steps} x 5), "
          f"{len(top_level)} top-level torch calls")  # fmt: skip
    weights = matrix_bytes(model)
    per_token = KVPages.bytes_per_token(model.args, model.dtype, args.kv_dtype)
    keys = rows * (args.context + 1) * per_token
    rate = (weights + keys) / best
    print(f"  reads {(weights + keys) / 2**20:,.0f} MiB a step (matrices {weights / 2**20:,.0f}, "
          f"keys and values {keys / 2**20:,.1f} as {args.kv_dtype}): {rate / 1e9:.1f} GB/s, "
          f"{rate / bandwidth:.0%} of the {bandwidth / 1e9:.1f} GB/s measured")  # fmt: skip
    print(f"  {'op':40s} {'calls':>6s} {'share':>7s}")
    for name, us in sorted(spent.items(), key=lambda item: -item[1])[: args.top]:
        print(f"  {name:40s} {calls[name]:6d} {us / total:7.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument(
        "--kernels",
        choices=["native", "torch"],
        default="native",
        help="the model on ninfer's native kernels (the instruction set torch dispatches "
        "to: set ATEN_CPU_CAPABILITY=avx2 for an AVX2 CPU's) or on torch's",
    )
    ap.add_argument("--kv-dtype", choices=["float16", "float32", "int8"], default="float16")
    ap.add_argument(
        "--packed-cache",
        metavar="DIR",
        help="the packed matrices kept in DIR as a server keeps them (its cache directory's "
        "packed/): mapped where kept, else packed into a file there and kept; default: "
        "packed into memory, as a server with --no-packed-cache",
    )
    args = ap.parse_args()
    bandwidth = read_bandwidth(args.threads)
    torch.set_num_threads(args.threads)
    cache = cache_dir(None, os.environ)
    path = resolve_model(args.model, cache)
    native = args.kernels == "native"
    if native:
        built = build_kernels(cache)
        if built.path is None:
            raise SystemExit(f"no native kernels: {built.reason}")
        load_kernels(built.path)
        print("kernels:", torch.ops.ninfer.configure(torch_isa(), args.threads, 100))
    loaded = load_model(
        str(path), dtype=torch.float32, device="cpu", max_positions=max(4096, args.context + 1),
        native=native, packed_cache=args.packed_cache, progress=print,
    )  # fmt: skip
    pages_needed = max(512, max(int(r) for r in args.rows.split(",")) * (args.context // PAGE + 1))
    kv = KVPages.allocate(
        loaded.transformer.args, n_pages=pages_needed, page_size=PAGE, dtype=torch.float32,
        device="cpu", kv_dtype=args.kv_dtype,
        keys_transposed=native,  # the native layers' layout
    )  # fmt: skip
    kv.zero_pages(list(range(kv.scratch_page + 1)))
    for rows in (int(r) for r in args.rows.split(",")):
        profile_rows(loaded.transformer, kv, rows, args, bandwidth)


if __name__ == "__main__":
    main()
