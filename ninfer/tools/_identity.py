"""Identity under load, from outside: a server's greedy answers to fixed prompts, taken
alone on a quiet machine, then again while busy processes take the cores and other
clients mix sampled requests among them, compared token for token. Used by
benchmarks/identity.py (thousands of answers on the real model) and by the suite's
short version (tests/test_identity.py, on the tiny model). No torch."""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import trio

__all__ = ["Outcome", "busy_processes", "loaded", "prompts", "reference", "solo_calls"]

# A busy loop that ends when the process that started it is gone (never outlives it).
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
SUBJECTS = ["lighthouses", "volcanoes", "honey bees", "the Roman roads", "glaciers",
            "tide pools", "paper making", "the printing press", "owls", "sourdough bread",
            "coral reefs", "the violin", "windmills", "desert foxes", "the Silk Road",
            "comets", "maple syrup", "the abacus", "sea otters", "stained glass"]  # fmt: skip
ASKS = ["Tell me three facts about {}.", "Write a short poem about {}.",
        "Explain {} to a child in two sentences.", "What is surprising about {}?"]  # fmt: skip


def prompts(count: int) -> list[str]:
    """`count` distinct chat prompts (ChatML, as SmolLM2's template writes them)."""
    out = []
    for i in range(count):
        ask = ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)])
        if i >= len(ASKS) * len(SUBJECTS):
            ask += f" (take {i})"
        out.append(f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n")
    return out


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes that each keep a core busy, until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@attrs.define
class Outcome:
    compared: int = 0
    differed: int = 0
    sampled: int = 0
    first_differences: list[dict[str, Any]] = attrs.field(factory=list)


async def reference(url: str, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer, alone."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for text in texts:
            r = await http.post("/v1/generate", json=_greedy(text, max_tokens))
            r.raise_for_status()
            out.append(r.json()["token_ids"])
    return out


def _greedy(text: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": text, "max_new_tokens": max_tokens, "temperature": 0}


async def loaded(
    url: str,
    texts: list[str],
    want: list[list[int]],
    *,
    answers: int,
    clients: int,
    max_tokens: int,
    greedy_share: float,
    seed: int = 1,
) -> Outcome:
    """`clients` clients mixing greedy requests (compared with `want`) and sampled ones
    until `answers` greedy answers were compared."""
    outcome = Outcome()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            while outcome.compared < answers:
                i = rng.randrange(len(texts))
                if rng.random() < greedy_share:
                    r = await http.post("/v1/generate", json=_greedy(texts[i], max_tokens))
                    r.raise_for_status()
                    got = r.json()["token_ids"]
                    outcome.compared += 1
                    if got != want[i]:
                        outcome.differed += 1
                        if len(outcome.first_differences) < 5:
                            outcome.first_differences.append(_difference(i, got, want[i]))
                else:
                    body = {"prompt": texts[i], "max_new_tokens": rng.randint(8, 48),
                            "temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31),
                            "ignore_eos": True}  # fmt: skip
                    r = await http.post("/v1/generate", json=body)
                    r.raise_for_status()
                    outcome.sampled += 1

        async with trio.open_nursery() as n:
            for k in range(clients):
                n.start_soon(client, k)
    return outcome


def _difference(prompt: int, got: list[int], want: list[int]) -> dict[str, Any]:
    same = 0
    while same < min(len(got), len(want)) and got[same] == want[same]:
        same += 1
    return {"prompt": prompt, "first_token_differing": same, "got": got, "want": want}


def solo_calls(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("ninfer_kernel_solo_calls_total "))
    return float(line.split()[1])
