"""Speculative decoding, measured: ninfer with and without --spec ngram, and llama-server
with and without its n-gram speculation, on three workloads, side by side in one run.

    .venv/bin/python benchmarks/speculative.py [--llama-server PATH] [--model NAME|PATH]
        [--clients 1,4,16] [--duration-s 20] [--draft-tokens 8] [--threads 2]
        [--workloads edit,json,chat] [--servers ninfer,ninfer-spec,llama,llama-spec]
        [--json out.json]

Workloads (OpenAI chat completions, greedy, each answer ending where the model ends it
or at its max_tokens):

- edit: fix the spelling mistakes of a paragraph (the answer quotes its prompt; the
  default model does not rewrite code, it describes it);
- json: a structured output (a JSON Schema response_format) and a tool call, in turn;
- chat: free questions.

Every server is started (each on a loopback port, with the same threads), then each
workload at each client count runs on one server after the other, in a closed loop
for --duration-s after each request of the workload once (an idle server takes no
CPU; taking each figure next to its peers keeps a shared machine's drift out of the
ratios). Reported per server, workload and clients: completion tokens per second, the
acceptance rate (ninfer: from /metrics; llama-server: from its answers' `timings`),
and whether each request's answer equals the first server's (ninfer without
speculation): the identity ninfer promises for its own speculation. llama-server runs
`--spec-type ngram-mod` for its speculation (found through --llama-server,
$LLAMA_SERVER or PATH; see benchmarks/race.py for how to build it). Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from race import _free_port, _running, find_llama_server

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model

# Texts with spelling mistakes: the answer is the text again, corrected.
TEXTS = [
    "The old lighthuose stood on the rocky clif for over a hundred yaers. Every night its "
    "keeper climbed the narow stairs to light the lamp, and every morning he wrote the "
    "wether in a small lether book that he kept by the window.",
    "Our team met on Monday to discus the new project. We agreed to finish the first "
    "draft by Friday, to share it with the clients next week, and to colect their "
    "coments before the end of the month.",
    "To make bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough "
    "for ten minutes, let it rise for an hour, shape it into a loaf and bake it in a hot "
    "oven untill the crust is golden.",
    "The library will be closed on Saturday becuase of the annual inventory. Books that "
    "are due that day may be returned on Monday without a fine, and the reading room "
    "will open again at nine o'clock.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                      "maxItems": 4},
    },
    "required": ["name", "age", "city", "email", "languages"],
    "additionalProperties": False,
}  # fmt: skip
PEOPLE = [
    "Maria Lopez is 34, lives in Madrid, writes to maria.lopez@example.com and speaks "
    "Spanish and English.",
    "Tom Becker, 51, from Hamburg (tom.becker@example.org), speaks German, Danish and English.",
    "Aiko Tanaka is 27 and lives in Osaka; her address is aiko@example.jp; she speaks Japanese.",
    "Jean Dupont, 45, Lyon, jean.dupont@example.fr, French and Italian.",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
QUESTIONS = [
    "Why is the sky blue? Answer in a few sentences.",
    "Give me three tips for learning to cook.",
    "What is the difference between a virus and a bacterium?",
    "Describe a good morning routine.",
    "How does a bicycle stay upright?",
    "Write a short story about a lost key.",
]


def workload(name: str) -> list[dict[str, Any]]:
    """The workload's request bodies (greedy chat completions, model name left out)."""
    if name == "edit":
        return [
            {"messages": [{"role": "user", "content":
                           f"Fix the spelling mistakes in this text:\n\n{text}"}],
             "max_tokens": 128}
            for text in TEXTS
        ]  # fmt: skip
    if name == "json":
        bodies: list[dict[str, Any]] = []
        for i, text in enumerate(PEOPLE):
            bodies.append({
                "messages": [{"role": "user", "content": f"Extract this person as JSON: {text}"}],
                "max_tokens": 120,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON, "strict": True}},
            })  # fmt: skip
            city = re.findall(r"(Madrid|Hamburg|Osaka|Lyon)", text)[0]
            bodies.append({
                "messages": [{"role": "user", "content":
                              f"What will the weather be in {city} for the next {i + 2} days?"}],
                "max_tokens": 80, "tools": [WEATHER_TOOL], "tool_choice": "required",
            })  # fmt: skip
        return bodies
    return [{"messages": [{"role": "user", "content": q}], "max_tokens": 128} for q in QUESTIONS]


def _answer(body: dict[str, Any]) -> Any:
    m = body["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    return m.get("content"), calls


async def _load(
    url: str, bodies: list[dict[str, Any]], clients: int, duration: float, slots: int
) -> dict[str, Any]:
    """Each body once (`slots` at a time: its answer is the one compared), then a closed
    loop: `clients` clients send the bodies in turn (each from its own offset) for
    `duration` seconds. Returns tokens/s, requests, the answers, and the llama-server
    draft counts found in its answers' `timings`."""
    answers: dict[int, Any] = {}
    tokens = requests = drafted = accepted = 0
    limits = httpx.Limits(max_connections=max(clients, slots) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as c:

        async def ask(i: int) -> tuple[int, Any, dict[str, Any]]:
            body = {"model": "m", "temperature": 0, **bodies[i % len(bodies)]}
            r = await c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            a = r.json()
            return a["usage"]["completion_tokens"], _answer(a), a.get("timings") or {}

        gate = trio.Semaphore(slots)
        async with trio.open_nursery() as n:
            for i in range(len(bodies)):

                async def warm(i: int = i) -> None:
                    async with gate:
                        answers[i] = (await ask(i))[1]

                n.start_soon(warm)
        start = time.monotonic()
        deadline = start + duration

        async def client(k: int) -> None:
            nonlocal tokens, requests, drafted, accepted
            i = k
            while time.monotonic() < deadline:
                count, _, timings = await ask(i)
                tokens += count
                requests += 1
                drafted += int(timings.get("draft_n", 0))
                accepted += int(timings.get("draft_n_accepted", 0))
                i += clients

        async with trio.open_nursery() as n:
            for k in range(clients):
                n.start_soon(client, k)
        elapsed = time.monotonic() - start
    return {
        "tokens_per_second": tokens / elapsed,
        "requests": requests,
        "answers": [answers[i] for i in range(len(bodies))],
        "drafted": drafted,
        "accepted": accepted,
    }


def _spec_counts(url: str) -> tuple[float, float]:
    """ninfer's drafted and accepted tokens so far, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for name in ("draft_tokens", "accepted_tokens"):
        m = re.search(rf"^ninfer_spec_decode_num_{name}_total (\S+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["draft_tokens"], values["accepted_tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="edit,json,chat")
    ap.add_argument("--servers", default="ninfer,ninfer-spec,llama,llama-spec")
    ap.add_argument("--logs", default="speculative-logs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    names = args.workloads.split(",")
    gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    llama = find_llama_server(args.llama_server)
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    slots = max(clients)
    servers: dict[str, tuple[list[str], str, str]] = {}
    for server in args.servers.split(","):
        port = _free_port()
        if server.startswith("ninfer"):
            spec = ["--spec", "ngram", "--draft-tokens", str(args.draft_tokens)] if (
                server == "ninfer-spec") else []  # fmt: skip
            cmd = [sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
                   "--threads", str(args.threads), "--max-concurrency", str(slots),
                   "--max-pending-requests", str(slots), "--no-access-log",
                   "--served-model-name", "m", *spec]  # fmt: skip
            servers[server] = (cmd, f"http://127.0.0.1:{port}", "/ready")
        elif llama is not None:
            spec = ["--spec-type", "ngram-mod"] if server == "llama-spec" else []
            cmd = [llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(args.threads), "-np", str(slots), "-c", str(slots * 1024),
                   "--no-repack", "--no-webui", "-cb", "--jinja", *spec]  # fmt: skip
            servers[server] = (cmd, f"http://127.0.0.1:{port}", "/health")
        else:
            print(f"{server}: llama-server not found (see --help); left out", file=sys.stderr)
    # Every server is started first, then each measurement runs on each server in
    # turn: on a shared machine whose speed drifts, the figures compared are taken
    # minutes apart at most, not a whole run apart. (An idle server takes no CPU.)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in servers}
    with contextlib.ExitStack() as stack:
        for server, (cmd, url, ready) in servers.items():
            print(f"{server}: {' '.join(cmd)}", file=sys.stderr)
            stack.enter_context(_running(cmd, url, ready, logs / f"{server}.log"))
        for name in names:
            for n in clients:
                for server, (_, url, _) in servers.items():
                    ninfer = server.startswith("ninfer")
                    before = _spec_counts(url) if ninfer else (0.0, 0.0)
                    row = trio.run(_load, url, workload(name), n, args.duration_s, slots)
                    if ninfer:
                        after = _spec_counts(url)
                        row["drafted"], row["accepted"] = (
                            after[0] - before[0], after[1] - before[1])  # fmt: skip
                    row["clients"] = n
                    results[server].setdefault(name, []).append(row)
                    print(f"{server} {name} x{n}: {row['tokens_per_second']:.1f} tok/s",
                          file=sys.stderr)  # fmt: skip
    _report(results, names, clients)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _report(
    results: dict[str, dict[str, list[dict[str, Any]]]], names: list[str], clients: list[int]
) -> None:
    servers = list(results)
    base = servers[0]
    print("\n| workload | clients | " + " | ".join(f"{s} tok/s" for s in servers)
          + " | " + " | ".join(f"{s} accepted" for s in servers if "spec" in s)
          + " | " + " | ".join(f"{s} / {base}" for s in servers[1:]) + " |")  # fmt: skip
    print("|---" * (2 + len(servers) + sum("spec" in s for s in servers) + len(servers) - 1) + "|")
    for name in names:
        for i, n in enumerate(clients):
            rows = {s: results[s][name][i] for s in servers}
            rates = [rows[s]["tokens_per_second"] for s in servers]
            acc = [
                f"{rows[s]['accepted'] / rows[s]['drafted']:.0%} of {rows[s]['drafted']:.0f}"
                if rows[s]["drafted"] else "-"
                for s in servers if "spec" in s
            ]  # fmt: skip
            ratios = [f"{r / rates[0]:.2f}x" for r in rates[1:]]
            print(f"| {name} | {n} | " + " | ".join(f"{r:.1f}" for r in rates) + " | "
                  + " | ".join(acc) + " | " + " | ".join(ratios) + " |")  # fmt: skip
    print(f"\nanswers equal to {base}'s (each workload's requests, at every client count):")
    for s in servers[1:]:
        same = total = 0
        for name in names:
            for i in range(len(clients)):
                a, b = results[s][name][i]["answers"], results[base][name][i]["answers"]
                same += sum(x == y for x, y in zip(a, b, strict=True))
                total += len(a)
        print(f"  {s}: {same} of {total}")


if __name__ == "__main__":
    sys.exit(main())
