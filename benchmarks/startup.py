"""Start-up to ready: ninfer (one code tree or several) against llama-server, taking turns.

    .venv/bin/python benchmarks/startup.py [--model NAME|PATH] [--rounds 2]
        [--tree LABEL=DIR ...] [--llama-server PATH] [--llama-args "-np 4 -c 8192"]
        [--cpu native|avx2] [--threads 2] [--idle-s 0] [--json out.json]

Each round starts, one after the other: every ninfer tree's "first" start, with an
empty cache directory (nothing kept: the self-check, the batching checks, the file's
digest, a SentencePiece tokenizer's merge order and the packed matrices all computed),
then every tree's "later" start, with the directory its first one left (what a server
restarted on the same machine does), then llama-server. Each is timed from launch
until its readiness route answers 200 (ninfer `/ready`, llama-server `/health`), then
stopped. Before each start the files it reads are read through once (the model file;
for ninfer also the packed matrices its cache directory keeps), so every start finds
them in the page cache, as a restart on a machine with memory to spare does (a virtual
machine whose balloon takes back cache pages evicts them within minutes). `--idle-s`
waits that long before each start: memory a server just freed is then no longer at
hand (a virtual machine with free page reporting hands it back to its host within
seconds, and a fresh huge page is then the host's to supply), as for a start that does
not follow a stop at once. Prints each start's seconds, the medians, and each ninfer
median over llama-server's.

`--tree LABEL=DIR` runs `python -m ninfer serve` from another checkout (its kernels
built there: `ninfer build-kernels` in it) to compare code; by default the tree this
file is in. `--cpu avx2` runs everything under ATEN_CPU_CAPABILITY=avx2 (and the AVX2
build of llama-server via --llama-server). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from race import AVX2_ENV, _free_port, _running, find_llama_server

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model

ROOT = Path(__file__).resolve().parent.parent


def _warm(*paths: str | Path) -> None:
    """The files read through once (into the page cache)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def _ninfer(tree: Path, gguf: str, cache: Path, env: dict[str, str], args: argparse.Namespace,
            logs: Path, label: str) -> float:  # fmt: skip
    time.sleep(args.idle_s)
    _warm(gguf, *sorted(cache.glob("packed/*.bin")))
    port = _free_port()
    cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
        "--threads", str(args.threads), "--cache-dir", str(cache), "--no-access-log",
    ]  # fmt: skip
    # run in the tree: `python -m` puts the working directory first on the path
    with _running(cmd, f"http://127.0.0.1:{port}", "/ready", logs / f"{label}.log",
                  env, cwd=tree) as (_proc, ready):  # fmt: skip
        return ready


def _llama(binary: str, gguf: str, env: dict[str, str], args: argparse.Namespace,
           logs: Path) -> float:  # fmt: skip
    time.sleep(args.idle_s)
    _warm(gguf)
    port = _free_port()
    cmd = [
        binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
        "-t", str(args.threads), *args.llama_args.split(), "--no-repack", "--no-webui",
    ]  # fmt: skip
    with _running(cmd, f"http://127.0.0.1:{port}", "/health", logs / "llama-server.log",
                  env) as (_proc, ready):  # fmt: skip
        return ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--llama-server")
    ap.add_argument("--llama-args", default="-np 4 -c 8192")
    ap.add_argument("--cpu", choices=["native", "avx2"], default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=0.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree]
    trees = trees or [("ninfer", ROOT)]
    env = {**os.environ, **(AVX2_ENV if args.cpu == "avx2" else {})}
    llama = find_llama_server(args.llama_server)
    times: dict[str, list[float]] = {}
    work = Path(tempfile.mkdtemp(prefix="ninfer-startup-"))
    try:
        for r in range(args.rounds):
            for label, _tree in trees:
                shutil.rmtree(work / f"cache-{label}", ignore_errors=True)
            for when, (label, tree) in itertools.product(("first", "later"), trees):
                name = f"{label} {when}"
                s = _ninfer(tree, gguf, work / f"cache-{label}", env, args, work, name)
                times.setdefault(name, []).append(s)
                print(f"round {r + 1}: {name} {s:.2f} s", flush=True)
            if llama is not None:
                s = _llama(llama, gguf, env, args, work)
                times.setdefault("llama-server", []).append(s)
                print(f"round {r + 1}: llama-server {s:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peer = statistics.median(times["llama-server"]) if "llama-server" in times else None
    print(f"\n{Path(gguf).name}, --cpu {args.cpu}, {args.threads} threads, launch to ready (s)")
    summary: dict[str, Any] = {}
    for name, values in times.items():
        med = statistics.median(values)
        ratio = f"  {med / peer:.2f}x llama-server" if peer and name != "llama-server" else ""
        print(f"  {name:24s} {' '.join(f'{v:6.2f}' for v in values)}   median {med:.2f}{ratio}")
        summary[name] = {"seconds": values, "median": med}
    if args.json:
        Path(args.json).write_text(json.dumps({"model": gguf, "cpu": args.cpu, **summary}))


if __name__ == "__main__":
    main()
