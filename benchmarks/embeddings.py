"""Embeddings under load: inputs a second at 1 and 16 concurrent requests of 8 inputs,
one server or several side by side, and what 64-input embedding requests do to streams
decoding beside them.

    .venv/bin/python benchmarks/embeddings.py NAME=URL [NAME=URL ...] [--seconds 10]
        [--rounds 2] [--gaps] [--streams 4] [--text FILE ...]

Inputs are sentences cut from plain text (by default the licence texts Debian ships in
/usr/share/common-licenses), each opened by a number no other input has, posted to
/v1/embeddings (`encoding_format` float). The servers take turns level by level, the
first server first in even rounds, last in odd ones, so that a noisy moment falls on
both. Run llama-server with `--embeddings --pooling mean` (its default for a decoder
GGUF is none, which its /v1/embeddings refuses) and `-np 16` for 16 requests at once.

--gaps: for each server, --streams streamed completions (`ignore_eos`, a token a chunk)
run alone, then again while one client posts 64-input embedding requests back to back;
prints the streams' median and p95 gap between chunks in both phases and their ratio
(the target: median < 2x alone). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from pathlib import Path

import httpx
import orjson

DEFAULT_TEXTS = sorted(str(p) for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())


def sentences(files: list[str]) -> list[str]:
    """The texts' sentences of 6 to 40 words."""
    words = " ".join(Path(f).read_text(errors="replace") for f in files).split()
    out, current = [], []
    for w in words:
        current.append(w)
        if w.endswith((".", ";", "?")) or len(current) >= 40:
            if len(current) >= 6:
                out.append(" ".join(current))
            current = []
    return out


class Inputs:
    """Sentences, each made unique by its number."""

    def __init__(self, texts: list[str]) -> None:
        self._texts = itertools.cycle(texts)
        self._n = itertools.count()
        self._lock = threading.Lock()

    def take(self, k: int) -> list[str]:
        with self._lock:
            return [f"{next(self._n)}. {next(self._texts)}" for _ in range(k)]


def embed(client: httpx.Client, model: str, inputs: list[str]) -> None:
    r = client.post("/v1/embeddings", json={"model": model, "input": inputs})
    r.raise_for_status()
    assert len(r.json()["data"]) == len(inputs)


def model_of(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def rate(url: str, inputs: Inputs, concurrency: int, per_request: int, seconds: float) -> float:
    """Inputs embedded a second by `concurrency` clients posting `per_request` inputs each,
    back to back, for `seconds`."""
    done = [0] * concurrency
    end = time.perf_counter() + seconds

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            model = model_of(c)
            while time.perf_counter() < end:
                embed(c, model, inputs.take(per_request))
                done[i] += per_request

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - began)


def stream_gaps(url: str, tokens: int, out: list[float]) -> None:
    """One streamed completion of `tokens` tokens; its gaps between chunks into `out`."""
    with httpx.Client(base_url=url, timeout=600) as c:
        body = {"model": model_of(c), "prompt": "Once upon a time", "max_tokens": tokens,
                "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
        last = None
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    out.append(now - last)
                last = now
                orjson.loads(line[6:])


def gaps(
    url: str, inputs: Inputs, streams: int, tokens: int, busy: bool
) -> tuple[list[float], float]:
    """The streams' gaps, and inputs embedded a second meanwhile when `busy`."""
    out: list[float] = []
    stop = threading.Event()
    embedded = [0]

    def embedder() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            model = model_of(c)
            while not stop.is_set():
                embed(c, model, inputs.take(64))
                embedded[0] += 64

    began = time.perf_counter()
    side = threading.Thread(target=embedder) if busy else None
    if side is not None:
        side.start()
    threads = [
        threading.Thread(target=stream_gaps, args=(url, tokens, out)) for _ in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if side is not None:
        side.join()
    return out, embedded[0] / (time.perf_counter() - began)


def _p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("servers", nargs="+", help="NAME=URL")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gaps", action="store_true")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--gap-tokens", type=int, default=200)
    parser.add_argument("--text", nargs="*", default=DEFAULT_TEXTS)
    args = parser.parse_args()
    servers = [tuple(s.split("=", 1)) for s in args.servers]
    inputs = Inputs(sentences(args.text))
    for _name, url in servers:  # a first request each: nothing measured pays a warm-up
        with httpx.Client(base_url=url, timeout=600) as c:
            embed(c, model_of(c), inputs.take(2))
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for level in (1, 16):
            order = servers if r % 2 == 0 else servers[::-1]
            for name, url in order:
                got = rate(url, inputs, level, 8, args.seconds)
                results.setdefault((name, level), []).append(got)
                print(f"round {r} {name} {level} x 8 inputs: {got:.1f} inputs/s", flush=True)
    print("\ninputs/s (requests of 8 inputs), median of rounds")
    for level in (1, 16):
        row = {n: statistics.median(results[(n, level)]) for n, _ in servers}
        first = row[servers[0][0]]
        print(f"  {level:>2} at once: " + ", ".join(
            f"{n} {v:.1f}" + (f" ({first / v:.2f}x)" if n != servers[0][0] and v else "")
            for n, v in row.items()))  # fmt: skip
    if not args.gaps:
        return
    print(f"\n{args.streams} streams' gaps between chunks, alone and beside 64-input requests")
    for name, url in servers:
        alone, _ = gaps(url, inputs, args.streams, args.gap_tokens, busy=False)
        beside, per_s = gaps(url, inputs, args.streams, args.gap_tokens, busy=True)
        a50, b50 = statistics.median(alone), statistics.median(beside)
        print(f"  {name}: median {a50 * 1000:.1f} -> {b50 * 1000:.1f} ms ({b50 / a50:.2f}x), "
              f"p95 {_p(alone, 0.95) * 1000:.1f} -> {_p(beside, 0.95) * 1000:.1f} ms, "
              f"worst {max(beside) * 1000:.0f} ms; {per_s:.1f} inputs/s beside them")  # fmt: skip


if __name__ == "__main__":
    main()
