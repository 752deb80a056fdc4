"""How true is Retry-After under closed-loop overload? Measured against ninfer itself.

    .venv/bin/python benchmarks/retry_after.py [--model NAME|PATH] [--levels 2,10]
        [--duration-s 40] [--max-tokens 32] [--max-concurrency 4] [--max-pending 4]
        [--threads 2] [--json out.json]

Starts `ninfer serve` on a loopback port with a request log, then for each level runs
level x capacity clients (capacity = max concurrency + max pending) in a closed loop
for --duration-s: each sends a chat completion of a fixed output length (ignore_eos),
and on a 429 waits exactly `retry-after-ms` (as the official SDKs do) and sends it
again. Afterwards the truth is read back: from the server's request log, the moments
places came back (a terminal record of any request that held a place); the k-th client
refused since a place last came back really got in when the k-th place came back.
Prints, per level, the refusals, the true waits, and the error of the estimate
(median and worst absolute error, and how many were outside the issue's bounds:
below half the true wait minus 1 s, or above twice it plus 1 s); the last line is
JSON. Refusals whose place had not come back before the level ended are not counted.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from race import _free_port, _running

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model

HELD_PHASES = ("prepare", "queued")  # refusals of requests that had taken a place
Pair = tuple[float, float]


async def _level(url: str, clients: int, args: argparse.Namespace) -> list[tuple[float, float]]:
    """Run the closed loop; return every 429 as (unix time received, told seconds)."""
    refusals: list[tuple[float, float]] = []
    stop_at = trio.current_time() + args.duration_s
    body = {
        "model": args.model_id,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client() -> None:
            while trio.current_time() < stop_at:
                r = await http.post("/v1/chat/completions", json=body)
                if r.status_code in (429, 503):
                    told = int(r.headers["retry-after-ms"]) / 1000
                    if r.status_code == 429:
                        refusals.append((time.time(), told))
                    await trio.sleep(told)
                else:
                    r.raise_for_status()

        async with trio.open_nursery() as n:
            for _ in range(clients):
                n.start_soon(client)
    return refusals


def _place_releases(log: Path, since: float) -> list[float]:
    out = []
    for line in log.read_bytes().splitlines():
        rec = json.loads(line)
        ts = rec["ts_unix_ms"] / 1000
        if ts < since:
            continue
        event = rec["event"]
        held = event in ("request_done", "request_cancelled", "request_error") or (
            event == "request_rejected" and rec.get("phase") in HELD_PHASES
        )
        if held:
            out.append(ts)
    return sorted(out)


def _errors(refusals: list[Pair], releases: list[float]) -> list[Pair]:
    """(told, true wait) for each refusal whose place came back before the level ended.

    The truth: places come back, in order, to the refused clients in the order they
    were refused (each place that frees goes to the client refused longest ago that
    is still waiting). That is what the server's count promises: the k-th refused
    client still waiting is told the k-th place."""
    events = sorted([(t, 1, 0.0) for t in releases] + [(w, 0, told) for w, told in refusals])
    waiting: deque[Pair] = deque()
    out = []
    for when, is_release, told in events:
        if not is_release:
            waiting.append((when, told))
        elif waiting:
            refused_at, was_told = waiting.popleft()
            out.append((was_told, when - refused_at))
    return out


def _mean_service(log: Path, since: float) -> float:
    """The mean engine time (prefill plus decode) of the requests done since `since`."""
    times = []
    for line in log.read_bytes().splitlines():
        rec = json.loads(line)
        if rec["event"] == "request_done" and rec["ts_unix_ms"] / 1000 >= since:
            t = rec["timings_seconds"]
            times.append(t["prefill"] + t["decode"])
    return statistics.mean(times) if times else 0.0


def _pace(url: str) -> dict[str, float]:
    """The engine's measured pace, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name, key in (
        ("ninfer_decode_step_seconds", "decode_step_s"),
        ("ninfer_prefill_seconds_per_token", "prefill_s_per_token"),
    ):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        out[key] = float(line.split()[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--levels", default="2,10", help="clients as multiples of capacity")
    ap.add_argument("--duration-s", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--max-pending", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model_path = resolve_model(args.model, cache_dir(None, {}), progress=print)
    capacity = args.max_concurrency + args.max_pending
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.jsonl"
        cmd = [
            sys.executable, "-m", "ninfer", "serve", "--model", str(model_path),
            "--port", str(port), "--threads", str(args.threads),
            "--max-concurrency", str(args.max_concurrency),
            "--max-pending-requests", str(args.max_pending),
            "--pending-timeout-ms", "600000", "--request-log-jsonl", str(log),
            "--model-id", "bench",
        ]  # fmt: skip
        args.model_id = "bench"
        with _running(cmd, url, "/ready", Path(tmp) / "server.out"):
            # one request first, so that the engine has measured its pace
            httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_new_tokens": 8},
                       timeout=120).raise_for_status()  # fmt: skip
            for level in (float(x) for x in args.levels.split(",")):
                clients = max(1, round(level * capacity))
                began = time.time()
                refusals = trio.run(_level, url, clients, args)
                time.sleep(2.0)  # the last places come back; the log is flushed per line
                releases = _place_releases(log, began)
                pairs = _errors(refusals, releases)
                errs = [abs(told - true) for told, true in pairs]
                outside = [
                    (told, true) for told, true in pairs
                    if told < true / 2 - 1 or told > 2 * true + 1
                ]  # fmt: skip
                p90 = statistics.quantiles(errs, n=10)[-1] if len(errs) > 1 else None
                row = {
                    "level": level,
                    "clients": clients,
                    "refusals": len(refusals),
                    "measured": len(pairs),
                    "true_wait_median_s": statistics.median(t for _, t in pairs) if pairs else None,
                    "abs_error_median_s": statistics.median(errs) if errs else None,
                    "abs_error_p90_s": p90,
                    "abs_error_worst_s": max(errs) if errs else None,
                    "late_median_s": statistics.median(t - w for t, w in pairs) if pairs else None,
                    "outside_bounds": len(outside),
                    "places_back_per_s": len(releases) / args.duration_s,
                    "told_median_s": statistics.median(t for t, _ in pairs) if pairs else None,
                    "service_mean_s": _mean_service(log, began),
                    **_pace(url),
                }  # fmt: skip
                results.append(row)
                print(
                    f"{level:g}x capacity ({clients} clients): {len(refusals)} refusals, "
                    f"{len(pairs)} measured; true wait median {row['true_wait_median_s']:.2f} s; "
                    f"|error| median {row['abs_error_median_s']:.3f} s, "
                    f"p90 {row['abs_error_p90_s']:.3f} s, worst {row['abs_error_worst_s']:.3f} s; "
                    f"told minus true, median {row['late_median_s']:+.3f} s; "
                    f"outside the bounds: {len(outside)}; "
                    f"places back {row['places_back_per_s']:.2f}/s, told median "
                    f"{row['told_median_s']:.2f} s; a request's engine time (prefill + "
                    f"decode) {row['service_mean_s']:.3f} s on average; the engine's pace: "
                    f"{row['decode_step_s']:.4f} s a step, {row['prefill_s_per_token']:.5f} s a "
                    "prompt token",
                    flush=True,
                )
    line = json.dumps({"capacity": capacity, "max_tokens": args.max_tokens, "levels": results})
    if args.json:
        args.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
