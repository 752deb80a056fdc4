"""What hostile or heavy requests cost everyone else: /health and a running stream.

    .venv/bin/python benchmarks/floods.py [--model NAME|PATH] [--seconds 10]
        [--only NAME,...] [--json out.json]

Starts `ninfer serve` on a loopback port (SmolLM2 by default) and, for each flood
below, runs it from two clients for --seconds while a third streams a long chat
completion and a fourth asks GET /health every 20 ms. Prints per flood: the
flood's requests and their statuses, /health latency (p50, p99, worst) and the
stream's gaps between chunks (p50, worst; and p50, p90 of those that ended while a
flood request was in flight); a baseline without a flood comes
first. The floods (issue 28's):

- count_tokens_60k: /v1/messages/count_tokens with 60,000 tiny messages (3.7 MB)
- chat_60k: chat completions with 60,000 messages
- responses_60k: Responses with 60,000 input Items
- tools_20k: chat completions with 20,000 tools (1.7 MB)
- wrong_model_60k: chat completions with 60,000 messages and an unknown model
- prompt_logprobs_880, prompt_logprobs_7300: one client, /v1/completions echo with
  logprobs on an 880- and a 7,300-token prompt (the other client idle)
- pattern_6: six chat completions whose schema has a string of pattern a{100000}

The last line is JSON. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from race import _free_port, _running

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model

MODEL = "bench"


def _floods() -> dict[str, tuple[int, Callable[[], tuple[str, dict[str, Any]]]]]:
    """name: (clients, a function giving the request's path and body)."""
    tiny = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(60_000)]
    tiny[-1] = {"role": "user", "content": "hi"}
    items = [{"role": "user", "content": "hi"} for _ in range(60_000)]
    params = {"type": "object", "properties": {"a": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}}
             for i in range(20_000)]  # fmt: skip
    user = [{"role": "user", "content": "hi"}]
    long_prompt = "the lighthouse keeper wrote another line in the log. " * 730
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "a{100000}"}},
              "required": ["s"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    return {
        "count_tokens_60k": (2, lambda: ("/v1/messages/count_tokens",
                                         {"model": MODEL, "messages": tiny})),
        "chat_60k": (2, lambda: ("/v1/chat/completions",
                                 {"model": MODEL, "messages": tiny, "max_tokens": 4})),
        "responses_60k": (2, lambda: ("/v1/responses", {"model": MODEL, "input": items,
                                                        "max_output_tokens": 16})),
        "tools_20k": (2, lambda: ("/v1/chat/completions", {"model": MODEL, "messages": user,
                                                           "tools": tools, "max_tokens": 4})),
        "wrong_model_60k": (2, lambda: ("/v1/chat/completions",
                                        {"model": "nope", "messages": tiny, "max_tokens": 4})),
        "prompt_logprobs_880": (1, lambda: ("/v1/completions", {
            "model": MODEL, "prompt": long_prompt[: len(long_prompt) // 730 * 80],
            "max_tokens": 1, "echo": True, "logprobs": 1})),
        "prompt_logprobs_7300": (1, lambda: ("/v1/completions", {
            "model": MODEL, "prompt": long_prompt, "max_tokens": 1, "echo": True,
            "logprobs": 1})),
        "pattern_6": (6, lambda: ("/v1/chat/completions", {
            "model": MODEL, "messages": user, "max_tokens": 64, "response_format": fmt})),
    }  # fmt: skip


async def _flood(url: str, name: str, seconds: float) -> dict[str, Any]:
    """One flooding client: the named request in a loop for `seconds`; its statuses and
    when each of its requests was in flight (wall-clock seconds)."""
    path, body = _floods()[name][1]()
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    statuses: Counter[int] = Counter()
    flights: list[tuple[float, float]] = []
    stop_at = trio.current_time() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while trio.current_time() < stop_at:
            sent = time.time()
            r = await http.post(path, content=content, headers=headers)
            flights.append((sent, time.time()))
            statuses[r.status_code] += 1
    return {"statuses": dict(statuses), "flights": flights}


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


async def _measure(url: str, seconds: float, flood: tuple[str, int] | None) -> dict[str, Any]:
    health: list[float] = []
    gaps: list[float] = []
    gap_ends: list[float] = []  # wall clock
    flights: list[tuple[float, float]] = []
    statuses: Counter[int] = Counter()
    stop = trio.Event()
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def prober() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                r = await http.get("/health")
                health.append(time.perf_counter() - t)
                assert r.status_code == 200
                await trio.sleep(0.02)

        async def streamer() -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": 4000, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
            while not stop.is_set():
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # (the blank line after each event is no gap)
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                            gap_ends.append(time.time())
                        last = now
                        if stop.is_set():
                            break

        async with trio.open_nursery() as n:
            n.start_soon(prober)
            n.start_soon(streamer)
            await trio.sleep(1.0)  # the stream under way
            health.clear()
            gaps.clear()
            gap_ends.clear()
            if flood is not None:  # in processes of their own: their JSON is not ours
                name, clients = flood
                cmd = [sys.executable, __file__, "--worker", name, "--url", url,
                       "--seconds", str(seconds)]  # fmt: skip

                async def worker() -> None:
                    done = await trio.run_process(cmd, capture_stdout=True)
                    got = json.loads(done.stdout)
                    statuses.update({int(k): v for k, v in got["statuses"].items()})
                    flights.extend((a, b) for a, b in got["flights"])

                for _ in range(clients):
                    n.start_soon(worker)
            await trio.sleep(seconds)
            stop.set()
    during = [g for g, end in zip(gaps, gap_ends, strict=True)
              if any(a <= end <= b for a, b in flights)]  # fmt: skip
    return {
        "flood_statuses": dict(statuses),
        "health_p50_ms": 1000 * _q(health, 0.5),
        "health_p99_ms": 1000 * _q(health, 0.99),
        "health_max_ms": 1000 * max(health, default=float("nan")),
        "stream_gap_p50_ms": 1000 * _q(gaps, 0.5),
        "stream_gap_max_ms": 1000 * max(gaps, default=float("nan")),
        # the gaps that ended while a flood request was in flight
        "stream_gap_in_flight_p50_ms": 1000 * _q(during, 0.5),
        "stream_gap_in_flight_p90_ms": 1000 * _q(during, 0.9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--only", default="", help="comma-separated flood names")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a flooding client process
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(trio.run(_flood, args.url, args.worker, args.seconds)))
        return
    model_path = resolve_model(args.model, cache_dir(None, {}), progress=print)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    floods = _floods()
    names = [n for n in args.only.split(",") if n] or list(floods)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "ninfer", "serve", "--model", str(model_path),
               "--port", str(port), "--model-id", MODEL, "--max-request-mib", "16"]  # fmt: skip
        with _running(cmd, url, "/ready", Path(tmp) / "server.out"):
            for name in ["baseline", *names]:
                flood = (name, floods[name][0]) if name in floods else None
                row = {"flood": name, **trio.run(_measure, url, args.seconds, flood)}
                rows.append(row)
                print(
                    f"{name}: statuses {row['flood_statuses']}; /health p50 "
                    f"{row['health_p50_ms']:.1f} ms, p99 {row['health_p99_ms']:.1f} ms, max "
                    f"{row['health_max_ms']:.1f} ms; stream gap p50 "
                    f"{row['stream_gap_p50_ms']:.1f} ms, max {row['stream_gap_max_ms']:.1f} ms; "
                    f"while a flood request was in flight p50 "
                    f"{row['stream_gap_in_flight_p50_ms']:.1f} ms, p90 "
                    f"{row['stream_gap_in_flight_p90_ms']:.1f} ms",
                    flush=True,
                )
    line = json.dumps({"seconds": args.seconds, "floods": rows})
    if args.json:
        args.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
