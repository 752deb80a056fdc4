"""ninfer replicas behind nginx, with one replica stopped mid-run: is anything lost?

    .venv/bin/python benchmarks/replicas.py [--replicas 2] [--model NAME|PATH]
        [--duration-s 60] [--max-tokens 32] [--max-concurrency 4] [--max-pending 4]
        [--threads 1] [--no-sigterm] [--json out.json]

Starts --replicas `ninfer serve` processes and Debian's nginx before them with the
shipped deploy/nginx.conf (tests/nginxlb.py; nothing is installed: it says what is
missing), then loads nginx with `ninfer bench`'s closed loop at twice one replica's
capacity (2 x (max concurrency + max pending) clients) for --duration-s, sends SIGTERM
to replica 0 halfway through, and prints a table and a last line of JSON:
{"replicas", "requests", "ok", "refused", "lost", "failed", "tok_per_s",
"tok_per_s_one_replica"}: `lost` counts answers that began (200) but did not end
properly (no [DONE], or an error event), `failed` 5xx other than 503 and transport
errors; `refused` the documented 429 and 503. The same load against one replica alone,
for the same time, gives tok_per_s_one_replica. On a small machine the replicas share
its cores: the point is the behaviour; the scaling is for bigger machines.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nginxlb import NGINX, balanced, start_replica, wait_ready

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model
from ninfer.tools._bench import BenchConfig, LevelResult, run_bench


def _load(url: str, args: argparse.Namespace, clients: int, stop: Any = None) -> LevelResult:
    cfg = BenchConfig(url=url, route="chat", model="m", clients=(clients,),
                      duration_s=args.duration_s, max_requests=100_000,
                      max_tokens=args.max_tokens, warmup_s=0.0)  # fmt: skip

    async def main() -> list[LevelResult]:
        async with trio.open_nursery() as n:
            if stop is not None:
                n.start_soon(stop)
            results = await run_bench(cfg, progress=False)
            n.cancel_scope.cancel()
        return results

    return trio.run(main)[0]


def _row(label: str, level: LevelResult) -> dict[str, Any]:
    s = level.summary()
    errors = s["errors"]
    lost = sum(n for e, n in errors.items() if "stream" in e)
    return {
        "setup": label,
        "requests": s["requests"],
        "ok": s["ok"],
        "refused": s["rejected_429"] + s["rejected_503"],
        "lost": lost,
        "failed": s["failed"] - lost,
        "cut": s["cut"],
        "errors": errors,
        "tok_per_s": round(s["tokens_per_second"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--max-pending", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-sigterm", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if NGINX is None:
        sys.exit("nginx is not installed (Debian: apt-get install nginx); nothing was started")
    model = resolve_model(args.model, cache_dir(None, {}))
    settings = {"max_concurrency": args.max_concurrency, "max_pending_requests": args.max_pending,
                "threads": args.threads, "served_model_name": "m",
                "graceful_timeout_s": 30}  # fmt: skip
    clients = 2 * (args.max_concurrency + args.max_pending)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        one_dir = Path(tmp) / "one"
        one_dir.mkdir()
        single = start_replica(model, one_dir, "alone", settings)
        try:
            wait_ready(single.url, single.proc, "/ready")
            rows.append(_row("one replica", _load(single.url, args, clients)))
        finally:
            single.proc.send_signal(signal.SIGTERM)
            single.proc.wait(120)
        lb_dir = Path(tmp) / "lb"
        lb_dir.mkdir()
        with balanced(model, lb_dir, args.replicas, **settings) as lb:

            async def stop_one() -> None:
                await trio.sleep(args.duration_s / 2)
                lb.replicas[0].proc.send_signal(signal.SIGTERM)

            label = f"{args.replicas} replicas behind nginx"
            if not args.no_sigterm:
                label += ", SIGTERM to one halfway"
            rows.append(_row(label, _load(lb.url, args, clients,
                                          None if args.no_sigterm else stop_one)))  # fmt: skip
    print(f"{clients} clients, closed loop, {args.duration_s:g} s, {args.max_tokens} tokens each")
    print(f"{'setup':<48} {'requests':>8} {'ok':>6} {'refused':>7} {'lost':>5} {'failed':>6} "
          f"{'tok/s':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['setup']:<48} {r['requests']:>8} {r['ok']:>6} {r['refused']:>7} "
              f"{r['lost']:>5} {r['failed']:>6} {r['tok_per_s']:>7}")  # fmt: skip
        if r["errors"]:
            print("   ", r["errors"])
    one, lb_row = rows
    out = {
        "replicas": args.replicas,
        "requests": lb_row["requests"],
        "ok": lb_row["ok"],
        "refused": lb_row["refused"],
        "lost": lb_row["lost"],
        "failed": lb_row["failed"],
        "tok_per_s": lb_row["tok_per_s"],
        "tok_per_s_one_replica": one["tok_per_s"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": out, "rows": rows}, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
