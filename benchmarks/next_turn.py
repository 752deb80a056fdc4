"""Time to first token of a conversation's next turn: what the prefix cache saves when a
chat goes on.

    .venv/bin/python benchmarks/next_turn.py URL [--conversations 6] [--answer-tokens 200]

For each of a few conversations (distinct opening questions): turn 1 asks its question
(streamed, `--answer-tokens` tokens with ignore_eos); turn 2 sends the whole history,
the answer included as the server wrote it, plus a follow-up question. Prints the
median time to first token of each turn and the prompt tokens of each, and the cached
tokens the server reported for turn 2 (OpenAI's `usage.prompt_tokens_details`). Run it
against `ninfer serve` and `ninfer serve --no-prefix-cache` to see the cache's share.
One client, one request at a time. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx
import orjson

QUESTIONS = (
    "Tell me about lighthouses.",
    "How do volcanoes form?",
    "What is the history of tea?",
    "Explain how bridges carry weight.",
    "Describe the life of honeybees.",
    "Why is the sky blue?",
    "How do trains stay on their tracks?",
    "What do astronauts eat?",
)


def _turn(
    client: httpx.Client, model: str, messages: list[dict[str, str]], tokens: int
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    assert first is not None
    return {"ttft": first - start, "text": "".join(text), "usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=200)
    args = ap.parse_args()
    with httpx.Client(base_url=args.url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        rows = []
        for question in QUESTIONS[: args.conversations]:
            history = [{"role": "user", "content": question}]
            one = _turn(client, model, history, args.answer_tokens)
            history += [{"role": "assistant", "content": one["text"]},
                        {"role": "user", "content": "Tell me more about that."}]  # fmt: skip
            two = _turn(client, model, history, 8)
            rows.append((one, two))
    for n, name in ((0, "turn 1"), (1, "turn 2")):
        ttft = statistics.median(r[n]["ttft"] for r in rows) * 1e3
        prompt = statistics.median(r[n]["usage"].get("prompt_tokens", 0) for r in rows)
        cached = statistics.median(
            (r[n]["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in rows
        )
        print(f"{name}: TTFT p50 {ttft:.0f} ms, prompt {prompt:.0f} tokens, cached {cached:.0f}")


if __name__ == "__main__":
    main()
