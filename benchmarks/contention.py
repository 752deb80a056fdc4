"""Steady steps and a fair share: ninfer and llama-server on a quiet machine and beside
other processes that keep the cores busy.

    .venv/bin/python benchmarks/contention.py [--cpu native|avx2] [--llama-server PATH]
        [--hogs 2] [--duration-s 20] [--stability-s 60] [--threads 2] [--json out.json]

Both servers (built and found as benchmarks/race.py says) run side by side; in turn:

1. one client, quiet: completion tokens/s;
2. one client beside `--hogs` busy processes (each a loop on one core, started before
   the block, stopped after it): tokens/s, as a share of the quiet figure;
3. rounds of four streams of `--stability-tokens` tokens (200), started together, for
   `--stability-s` (60) on the quiet machine: the gaps between a stream's tokens, each one
   decode step of the same four rows (no prompt is prefilled between two tokens of a
   round; contexts stay short, so attention grows little): p50, p95, p99 and p95 / p50;
4. the same rounds on ninfer's engine alone, in this process (no HTTP, no event loop: the
   decode step itself, timed on the engine thread): p50, p95, p99 and p95 / p50.

Every block records the CPU that processes other than the two servers, the hogs and
this client took (the quiet blocks are rerun, up to twice, when that passes
--busy-cores). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # the race's servers and blocks, shared

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model
from ninfer.tools._identity import HOG


@contextlib.contextmanager
def hogs(count: int) -> Any:
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def engine_steps(gguf: str, threads: int, rounds: int, tokens: int) -> dict[str, Any]:
    """Rounds of four rows decoded together on the engine alone: each decode step's time."""
    import threading
    import time

    import structlog

    from ninfer.engine import EngineConfig, Finish, GenerationRequest, SamplingParams
    from ninfer.engine import _engine as engine_module
    from ninfer.engine._runtime import configure_process, create_engine

    steps: list[float] = []
    plain = engine_module.Engine._decode_step

    def timed(self: Any, *prompts: Any) -> None:
        began = time.perf_counter()
        plain(self, *prompts)
        if len(self._decoding) == 4:
            steps.append(time.perf_counter() - began)

    engine_module.Engine._decode_step = timed  # type: ignore[method-assign]

    class Sink:
        def __init__(self) -> None:
            self.cv = threading.Condition()
            self.done = 0

        def deliver(self, events: list[Any]) -> None:
            with self.cv:
                self.done += sum(isinstance(e, Finish) for _, e in events)
                self.cv.notify_all()

    sink = Sink()
    config = EngineConfig(kv_capacity=8192, threads=threads)
    log = structlog.wrap_logger(structlog.PrintLogger(sys.stderr))
    eng = create_engine(lambda: gguf, config, sink, log=log, progress=lambda _m: None)
    ready = threading.Event()

    def run() -> None:
        configure_process(threads=threads)
        eng.run(on_ready=lambda _m: ready.set())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(600)
    assert eng.model is not None
    tok = eng.model.tokenizer
    prompt = tuple(tok.encode("<|im_start|>user\nWrite a story about a cat.<|im_end|>\n"
                              "<|im_start|>assistant\n"))  # fmt: skip
    for r in range(rounds):
        for i in range(4):
            sampling = SamplingParams(temperature=0.7, seed=i)
            eng.submit(GenerationRequest(f"r{r}-{i}", prompt, tokens, sampling, ignore_eos=True))
        with sink.cv:
            sink.cv.wait_for(lambda r=r: sink.done == 4 * (r + 1), timeout=600)
    eng.shutdown()
    thread.join(60)
    engine_module.Engine._decode_step = plain  # type: ignore[method-assign]
    steps.sort()
    pct = lambda q: steps[min(len(steps) - 1, int(q / 100 * len(steps)))]  # noqa: E731
    return {"steps": len(steps), "p50": pct(50), "p95": pct(95), "p99": pct(99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", choices=["native", "avx2"], default="native")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-server-avx2", default=None)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--route", choices=["chat", "completions"], default="chat")
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--stability-tokens", type=int, default=200)
    ap.add_argument("--stability-s", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy-cores", type=float, default=0.15)
    ap.add_argument("--max-reruns", type=int, default=2)
    ap.add_argument("--ninfer-args", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default="race-logs")
    args = ap.parse_args()
    gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    env = {**os.environ, **(race.AVX2_ENV if args.cpu == "avx2" else {})}
    llama = race.find_llama_server(
        args.llama_server_avx2 if args.cpu == "avx2" else args.llama_server,
        "LLAMA_SERVER_AVX2" if args.cpu == "avx2" else "LLAMA_SERVER",
    )
    out: dict[str, Any] = {"cpu": args.cpu, "hogs": args.hogs}
    with contextlib.ExitStack() as stack:
        port = race._free_port()
        n_url = f"http://127.0.0.1:{port}"
        n_cmd = [
            sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
            "--threads", str(args.threads), "--max-concurrency", "16", "--no-access-log",
            *args.ninfer_args.split(),
        ]  # fmt: skip
        n_proc, _ = stack.enter_context(
            race._running(n_cmd, n_url, "/ready", logs / "ninfer-contention.log", env)
        )
        servers = [("ninfer", n_url, None, n_proc.pid)]
        if llama is not None:
            port = race._free_port()
            l_url = f"http://127.0.0.1:{port}"
            l_cmd = [
                llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(args.threads), "-np", "16", "-c", str(16 * 512),
                "--no-repack", "--no-webui", "-cb",
            ]  # fmt: skip
            l_proc, _ = stack.enter_context(
                race._running(l_cmd, l_url, "/health", logs / "llama-contention.log", env)
            )
            servers.append(("llama-server", l_url, "peer", l_proc.pid))
        pids = [p for *_, p in servers]

        def quiet(name: str, url: str, model: str | None, clients: int, seconds: float,
                  warm: float) -> dict[str, Any]:  # fmt: skip
            args.duration_s = seconds
            for _attempt in range(args.max_reruns + 1):
                row = race._block(url, args, model, clients, pids, warm)
                if row["other_cores"] <= args.busy_cores:
                    break
            return row

        def stability(url: str, model: str | None) -> dict[str, Any]:
            """Rounds of four streams started together until --stability-s: every gap
            between two tokens of a stream is one decode step of the same four rows."""
            cfg = race.BenchConfig(
                url=url, route=args.route, model=model, clients=(4,), duration_s=0.1,
                grace_s=600.0, max_tokens=args.stability_tokens, warmup_s=0.0,
            )  # fmt: skip
            mine = [os.getpid(), *pids]
            began, total0 = race.time.monotonic(), race._cpu_ticks()
            own0 = sum(race._proc_ticks(p) for p in mine)
            gaps: list[float] = []
            rounds = 0
            while race.time.monotonic() - began < args.stability_s:
                (level,) = race.trio.run(lambda: race.run_bench(cfg, progress=False))
                gaps += [g for sample in level.samples for g in sample.gaps]
                rounds += 1
            other = (race._cpu_ticks() - total0) - (sum(race._proc_ticks(p) for p in mine) - own0)
            seconds = race.time.monotonic() - began
            gaps.sort()
            pct = lambda q: gaps[min(len(gaps) - 1, int(q / 100 * len(gaps)))]  # noqa: E731
            return {
                "itl_p50": pct(50), "itl_p95": pct(95), "itl_p99": pct(99), "rounds": rounds,
                "gaps": len(gaps), "other_cores": round(max(0, other) / race.CLK_TCK / seconds, 3),
            }  # fmt: skip

        duration = args.duration_s
        for name, url, model, _pid in servers:
            q = quiet(name, url, model, 1, duration, 3.0)
            with hogs(args.hogs) as hog_pids:
                args.duration_s = duration
                h = race._block(url, args, model, 1, pids + hog_pids, 0.0)
            s = stability(url, model)
            itl = (s["itl_p50"], s["itl_p95"], s["itl_p99"])
            out[name] = {
                "quiet_tok_s": q["tokens_per_second"],
                "hogged_tok_s": h["tokens_per_second"],
                "share": h["tokens_per_second"] / q["tokens_per_second"],
                "itl_p50_p95_p99_s": itl,
                "itl_p95_over_p50": itl[1] / itl[0] if itl[0] else None,
                "quiet_other_cores": q["other_cores"],
                "stability_other_cores": s["other_cores"],
            }
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
    print(
        f"\n--cpu {args.cpu}, {args.hogs} busy processes beside one client; rounds of four "
        f"streams of {args.stability_tokens} tokens for {args.stability_s:g} s, quiet"
    )
    print("| server | quiet tok/s | beside the hogs | share | ITL p50 / p95 / p99 ms (4 streams) "
          "| p95 / p50 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, *_ in servers:
        r = out[name]
        p50, p95, p99 = (v * 1e3 for v in r["itl_p50_p95_p99_s"])
        print(f"| {name} | {r['quiet_tok_s']:.1f} | {r['hogged_tok_s']:.1f} | {r['share']:.0%} | "
              f"{p50:.1f} / {p95:.1f} / {p99:.1f} | {r['itl_p95_over_p50']:.2f} |")  # fmt: skip
    if "ninfer" in out:
        env_before = dict(os.environ)
        os.environ.update(race.AVX2_ENV if args.cpu == "avx2" else {})
        alone = engine_steps(gguf, args.threads, 12, args.stability_tokens)
        os.environ.clear()
        os.environ.update(env_before)
        out["engine_steps"] = alone
        ratio = alone["p95"] / alone["p50"]
        print(
            f"\nninfer's engine alone, {alone['steps']} decode steps of 4 rows: p50 "
            f"{alone['p50'] * 1e3:.1f} / p95 {alone['p95'] * 1e3:.1f} / p99 "
            f"{alone['p99'] * 1e3:.1f} ms, p95 / p50 {ratio:.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
