"""The first answer a user sees: requests that name no sampling field, sent to one server
or several side by side, and how many are right, how many end by themselves, and how
long they run.

    .venv/bin/python benchmarks/defaults.py NAME=URL [NAME=URL ...] [--route chat,completions]
        [--rounds 5] [--max-tokens 200] [--concurrency 4]

Each question has a known one-word answer (a capital, a planet, a number). On the chat
route it is sent as one user message to /v1/chat/completions; on the completions route
as `Question: ...\\nAnswer:` to /v1/completions (for base models without a chat
template). The body names the model, the messages or prompt and `max_tokens` (a cap, so
that a run that does not end costs a bounded time; a web UI sends none) and nothing
else: temperature, top_p, top_k, min_p, penalties and seed are each server's defaults.

An answer is right when the expected word (or one of its forms) is in it: in the whole
message on the chat route, in the text before the first blank line or next "Question:"
on the completions route (what a base model writes after that is another question). It
ended by itself when finish_reason is `stop` (end-of-sequence), not `length`. The
servers take turns round by round (the first server first in even rounds), so a noisy
moment falls on both. Prints, per server and route: right answers, answers ended by
themselves, mean completion tokens and mean seconds a request. Not part of the test
suite; docs/api.md ("Sampling defaults") has the figures that chose ninfer's defaults.
"""

from __future__ import annotations

import argparse
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

QUESTIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What is the capital of Italy?", r"\brome\b"),
    ("What is the capital of Germany?", r"\bberlin\b"),
    ("What is the capital of Spain?", r"\bmadrid\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("How many days are in a week?", r"\b(7|seven)\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
]


def ask(client: httpx.Client, model: str, route: str, question: str, max_tokens: int
        ) -> tuple[str, str, int, float]:  # fmt: skip
    """(the answer's text, its finish_reason, completion tokens, seconds)."""
    if route == "chat":
        path = "/v1/chat/completions"
        text = f"{question} Answer in one sentence."
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens}  # fmt: skip
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": f"Question: {question}\nAnswer:",
                "max_tokens": max_tokens}  # fmt: skip
    start = time.perf_counter()
    r = client.post(path, json=body)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise SystemExit(f"{client.base_url}{path}: {r.status_code} {r.text[:300]}")
    out = r.json()
    choice = out["choices"][0]
    answer = choice["message"]["content"] if route == "chat" else choice["text"]
    return answer or "", choice["finish_reason"], int(out["usage"]["completion_tokens"]), elapsed


def judged(route: str, answer: str) -> str:
    """The part of an answer that is judged: a base model's first answer only."""
    if route == "chat":
        return answer
    return re.split(r"\n\s*\n|Question:", answer.strip(), maxsplit=1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("servers", nargs="+", help="NAME=URL")
    ap.add_argument("--route", default="chat,completions", help="chat, completions or both")
    ap.add_argument("--rounds", type=int, default=5, help="each question this many times")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", help="the model's name (default: each server's first)")
    ap.add_argument("--show", action="store_true", help="print each wrong answer")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    servers = []
    for spec in args.servers:
        name, _, url = spec.partition("=")
        client = httpx.Client(base_url=url, timeout=args.timeout)
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        servers.append((name, client, model))
    routes = args.route.split(",")
    results: dict[tuple[str, str], list[tuple[bool, str, int, float]]] = {}
    with ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for name, client, model in order:
                for route in routes:
                    jobs = [(q, rx, pool.submit(ask, client, model, route, q, args.max_tokens))
                            for q, rx in QUESTIONS]  # fmt: skip
                    for q, rx, job in jobs:
                        answer, finish, tokens, secs = job.result()
                        right = re.search(rx, judged(route, answer), re.IGNORECASE) is not None
                        if args.show and not right:
                            print(f"[{name} {route}] {q!r} -> {answer[:160]!r}")
                        results.setdefault((name, route), []).append((right, finish, tokens, secs))
    print("server | route | right | ended by itself | mean tokens | mean s")
    print("---|---|---|---|---|---")
    for route in routes:
        for name, _, _ in servers:
            got = results[(name, route)]
            n = len(got)
            right = sum(g[0] for g in got)
            ended = sum(g[1] == "stop" for g in got)
            tokens = sum(g[2] for g in got) / n
            secs = sum(g[3] for g in got) / n
            print(f"{name} | {route} | {right}/{n} | {ended}/{n} | {tokens:.0f} | {secs:.1f}")


if __name__ == "__main__":
    main()
