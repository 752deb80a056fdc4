"""What clients that send huge `max_tokens` defaults get admitted: measured against ninfer.

    .venv/bin/python benchmarks/large_budgets.py [--model NAME|PATH] [--clients 8]
        [--max-tokens 16384] [--stop-after 48] [--reserve 512,8192] [--threads 2]
        [--json out.json]

pydantic-ai sends `max_tokens: 16384` and litellm's Anthropic provider 128000; the
OpenAI and Anthropic routes clamp such a budget to what the context leaves and reserve
at admission only the prompt plus --default-max-tokens of it. For each reservation
given (--reserve: values of --default-max-tokens; one as large as the context is what
reserving the whole clamped budget would do) this starts `ninfer serve`, sends
--clients streamed chat completions at once with the large budget (`ignore_eos`;
each client reads --stop-after content chunks and closes the stream, which cancels
its request), samples `/metrics`, and prints the most requests that ran at once, the
time until every client had its first token, and the most KV pages in use. The last
line is JSON. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from race import _free_port, _running

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _one_setting(url: str, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": args.model_id,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    first_at: list[float] = []
    most_running = most_pages = 0.0
    start = trio.current_time()
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client() -> None:
            chunks = 0
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        chunks += 1
                        if chunks == 1:
                            first_at.append(trio.current_time() - start)
                        if chunks >= args.stop_after:
                            return  # the client has what it wanted: closing cancels it

        async def sample(done: trio.Event) -> None:
            nonlocal most_running, most_pages
            while not done.is_set():
                text = (await http.get("/metrics")).text
                most_running = max(most_running, _gauge(text, "ninfer_num_requests_running"))
                most_pages = max(most_pages, _gauge(text, "ninfer_kv_pages_used"))
                await trio.sleep(0.05)

        done = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(sample, done)
            async with trio.open_nursery() as clients:
                for _ in range(args.clients):
                    clients.start_soon(client)
            done.set()
    return {
        "most_running": int(most_running),
        "all_first_token_s": round(max(first_at), 2),
        "wall_s": round(trio.current_time() - start, 2),
        "most_kv_pages_used": int(most_pages),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--stop-after", type=int, default=48)
    p.add_argument("--reserve", default="512,8192")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = resolve_model(args.model, cache_dir(None, {}))
    args.model_id = "bench"
    rows = []
    for reserve in [int(x) for x in args.reserve.split(",")]:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable, "-m", "ninfer", "serve", "--model", str(model), "--port", str(port),
            "--served-model-name", args.model_id, "--threads", str(args.threads),
            "--max-concurrency", str(args.clients), "--default-max-tokens", str(reserve),
            "--log-stats-interval-ms", "0",
        ]  # fmt: skip
        with (
            tempfile.TemporaryDirectory() as tmp,
            _running(cmd, url, "/ready", Path(tmp) / "server.log"),
        ):
            row = {"reserve_tokens": reserve, **trio.run(_one_setting, url, args)}
        rows.append(row)
        print(
            f"reserve {reserve:>6} tokens: {row['most_running']} of {args.clients} ran at once, "
            f"every client had a token after {row['all_first_token_s']} s, "
            f"at most {row['most_kv_pages_used']} KV pages in use, {row['wall_s']} s in all"
        )
    out = {"clients": args.clients, "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
