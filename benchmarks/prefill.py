"""Long prompts: time to first token and prompt tokens/s at several prompt lengths, and
what a long prompt does to a stream running beside it; one server or several side by side.

    .venv/bin/python benchmarks/prefill.py NAME=URL [NAME=URL ...] [--sizes 500,2000,8000]
        [--rounds 3] [--gaps] [--text FILE ...]

Each prompt is a slice of plain text (by default the licence texts Debian ships in
/usr/share/common-licenses, joined), opened by a line no other prompt has, so no server
can reuse a cached prefix; each size takes another slice each round. A prompt is sent
to /v1/completions with `max_tokens` 1 and temperature 0, not streamed; its time is the
time to its first token, and the server's `usage.prompt_tokens` / that time is its prompt
rate. The servers take turns request by request (the first server first in even rounds,
last in odd ones), so that a noisy moment falls on both. Run llama-server with `-np 1
-c 16384` (or larger than the largest size) and ninfer with a context that holds it.

--gaps: for each server and size, one streamed request runs alone (`ignore_eos`, 1 token
a chunk) for --gap-tokens tokens, then again while a long prompt of that size is sent
beside it; prints the stream's median and worst gap between tokens alone and while the
long prompt is prefilled, and the long prompt's rate beside the stream against its rate
alone. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx
import orjson

DEFAULT_TEXTS = sorted(str(p) for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())


def corpus(files: list[str]) -> list[str]:
    """The texts' words, in order."""
    words: list[str] = []
    for f in files:
        try:
            words += Path(f).read_text(encoding="utf-8", errors="replace").split()
        except (OSError, IsADirectoryError):
            continue
    return words


def count_tokens(client: httpx.Client, text: str) -> int:
    """The server's token count of `text` (llama-server's and ninfer's /tokenize)."""
    r = client.post("/tokenize", json={"content": text})
    r.raise_for_status()
    return len(r.json()["tokens"])


class Prompts:
    """Unique prompts of about n tokens: a fresh first line, then words from a moving
    offset into the corpus (sized by one server's tokenizer: the words a token)."""

    def __init__(self, words: list[str], client: httpx.Client) -> None:
        self.words = words
        sample = " ".join(words[:2000])
        self.words_per_token = 2000 / count_tokens(client, sample)
        self.offset = 0

    def make(self, n: int) -> str:
        take = int(n * self.words_per_token)
        if take > len(self.words):
            raise SystemExit(f"the texts hold {len(self.words)} words; {take} are needed")
        if self.offset + take > len(self.words):
            self.offset = 0
        body = " ".join(self.words[self.offset : self.offset + take])
        self.offset += max(1, take // 3)
        return f"Document {uuid.uuid4().hex}:\n{body}"


def complete(client: httpx.Client, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the answer's one token, the prompt's tokens as the server counted)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise SystemExit(f"{client.base_url}: {r.status_code} {r.text[:300]}")
    return elapsed, int(r.json()["usage"]["prompt_tokens"])


def stream_gaps(client: httpx.Client, model: str, tokens: int, started: threading.Event,
                gaps: list[tuple[float, float]]) -> None:  # fmt: skip
    """A streamed completion of `tokens` tokens: (time, gap since the last) per token."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}  # fmt: skip
    last = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if not any(c.get("text") for c in chunk.get("choices") or ()):
                continue
            now = time.perf_counter()
            if last is None:
                started.set()
            else:
                gaps.append((now, now - last))
            last = now
    started.set()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("nan")


def race(servers: list[tuple[str, httpx.Client, str]], prompts: Prompts, sizes: list[int],
         rounds: int) -> None:  # fmt: skip
    print("size | server | prompt tokens | TTFT s (median) | prompt tok/s (median) | ratio")
    print("---|---|---|---|---|---")
    for size in sizes:
        got: dict[str, list[tuple[float, int]]] = {name: [] for name, _, _ in servers}
        for r in range(rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for name, client, model in order:
                got[name].append(complete(client, model, prompts.make(size)))
        first = None
        for name, _, _ in servers:
            ttft = _median([t for t, _ in got[name]])
            rate = _median([n / t for t, n in got[name]])
            tokens = int(_median([float(n) for _, n in got[name]]))
            first = first or rate
            print(f"{size} | {name} | {tokens} | {ttft:.2f} | {rate:.0f} | {rate / first:.2f}x")


def gaps(servers: list[tuple[str, httpx.Client, str]], prompts: Prompts, sizes: list[int],
         stream_tokens: int) -> None:  # fmt: skip
    print("\nsize | server | stream gap p50 alone ms | worst alone | p50 beside | p90 beside "
          "| worst beside | long prompt tok/s alone | beside | share")  # fmt: skip
    print("---|---|---|---|---|---|---|---|---|---")
    for size in sizes:
        for name, client, model in servers:
            alone: list[tuple[float, float]] = []
            stream_gaps(client, model, stream_tokens, threading.Event(), alone)
            t_alone, n_alone = complete(client, model, prompts.make(size))
            beside: list[tuple[float, float]] = []
            started = threading.Event()
            side = httpx.Client(base_url=str(client.base_url), timeout=client.timeout)
            th = threading.Thread(target=stream_gaps,
                                  args=(side, model, stream_tokens, started, beside))  # fmt: skip
            th.start()
            started.wait()
            t0 = time.perf_counter()
            t_long, n_long = complete(client, model, prompts.make(size))
            t1 = time.perf_counter()
            th.join()
            during = [g for at, g in beside if t0 <= at <= t1 + 0.5]
            a = [g for _, g in alone]
            print(f"{size} | {name} | {_median(a) * 1e3:.0f} | {max(a, default=0) * 1e3:.0f} | "
                  f"{_median(during) * 1e3:.0f} | {_p90(during) * 1e3:.0f} | "
                  f"{max(during, default=0) * 1e3:.0f} | "
                  f"{n_alone / t_alone:.0f} | {n_long / t_long:.0f} | "
                  f"{(n_long / t_long) / (n_alone / t_alone):.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("servers", nargs="+", help="NAME=URL")
    ap.add_argument("--sizes", default="500,2000,8000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="the model's name (default: each server's first)")
    ap.add_argument("--text", nargs="*", default=DEFAULT_TEXTS)
    ap.add_argument("--gaps", action="store_true")
    ap.add_argument("--gap-tokens", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    servers = []
    for spec in args.servers:
        name, _, url = spec.partition("=")
        client = httpx.Client(base_url=url, timeout=args.timeout)
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        servers.append((name, client, model))
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = Prompts(corpus(args.text), servers[0][1])
    for _, client, model in servers:  # warm each server (its first request's costs)
        complete(client, model, prompts.make(64))
    race(servers, prompts, sizes, args.rounds)
    if args.gaps:
        gaps(servers, prompts, sizes, args.gap_tokens)


if __name__ == "__main__":
    main()
