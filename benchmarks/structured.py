"""Structured outputs a small model finishes: ninfer beside llama-server on the same GGUF.

    .venv/bin/python benchmarks/structured.py [--model smollm2-135m-instruct]
        [--llama-server PATH | --llama-url URL] [--url URL] [--seeds 25]
        [--max-tokens 100] [--sampling server|llama] [--json out.json]

The same requests go to both servers, one at a time, alternating: the openai SDK's
`chat.completions.parse()` with three pydantic models (City: name, country, population;
Person: name, age, height_m; Recipe: nested, with an array of objects and an enum), the
City schema sent raw as pydantic writes it (no `additionalProperties`, `strict: true`:
what Instructor's JSON modes and vLLM- or Ollama-style clients send), a tool call with a
number and an integer argument (`tool_choice: required`, one call: llama-server's
default, where OpenAI's and ninfer's allow several), each with --seeds seeds at
each server's default sampling (--sampling llama: llama-server's sent to both), and
`json_object` for "Describe Paris as JSON." at temperature 0 (once: it is
deterministic). For each case and server it prints:

- finished: the answer ended by itself (`stop`, or `tool_calls` for the tool) and its
  JSON validates against the schema the request sent (jsonschema);
- undeclared: answers with a key the schema does not declare (where the schema says
  nothing of `additionalProperties`; JSON Schema allows such keys, the client did not ask
  for them);
- runaway: answers with a number of more than 16 digits before or after the point
  (llama.cpp's cap is 16, ninfer's 15);
- long: answers with a number of 10 or more digits in a part (a population may need
  them; a height or a price does not);
- tokens: completion tokens per answer (mean).

ninfer is started on --model unless --url names a running one; llama-server is started
on the same file with --llama-server PATH (or $LLAMA_SERVER; `--jinja` for the tool
case), or --llama-url names a running one. Not part of the test suite; the figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
from race import _free_port, _running, find_llama_server

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


class Person(pydantic.BaseModel):
    name: str
    age: int
    height_m: float


class Ingredient(pydantic.BaseModel):
    name: str
    grams: float


class Recipe(pydantic.BaseModel):
    title: str
    difficulty: Literal["easy", "medium", "hard"]
    servings: int
    ingredients: list[Ingredient]


THERMOSTAT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "room": {"type": "string"},
        "celsius": {"type": "number"},
        "minutes": {"type": "integer"},
    },
    "required": ["room", "celsius", "minutes"],
}
TOOLS = [{"type": "function", "function": {
    "name": "set_thermostat", "description": "Set a room's temperature for a while.",
    "parameters": THERMOSTAT}}]  # fmt: skip


# llama-server's default sampling (ninfer's, for a file without a preset, is OpenAI's:
# temperature 1, no top-k, top-p or min-p).
LLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (name, kind, pydantic model or schema, prompt)
CASES: list[tuple[str, str, Any, str]] = [
    ("City parse()", "parse", City, "Give me a large city: its name, country and population."),
    ("Person parse()", "parse", Person, "Invent a person: name, age and height in meters."),
    ("Recipe parse() (nested, array, enum)", "parse", Recipe, "Write a short pancake recipe."),
    ("City raw schema, strict", "raw", City.model_json_schema(),
     "Give me a large city: its name, country and population."),
    ("tool call (number, integer)", "tool", THERMOSTAT,
     "Set the living room to 21.5 degrees for 90 minutes."),
    ("json_object, temperature 0", "object", {"type": "object"}, "Describe Paris as JSON."),
]  # fmt: skip


def undeclared(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    """Whether `value` has a key that its (sub)schema neither declares nor opens."""
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return undeclared(value, target, root)
    for kw in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(kw), list):
            return all(undeclared(value, s, root) for s in schema[kw])
    if isinstance(value, dict):
        props = schema.get("properties", {})
        closed = "properties" in schema and "additionalProperties" not in schema
        if closed and any(k not in props for k in value):
            return True
        return any(undeclared(v, props.get(k), root) for k, v in value.items())
    if isinstance(value, list):
        return any(undeclared(v, schema.get("items"), root) for v in value)
    return False


def longest_number_part(text: str) -> int:
    """The most digits in one run of a number in a JSON text (not inside strings)."""
    in_string = escaped = False
    run = longest = 0
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch.isdigit():
            run += 1
            longest = max(longest, run)
        else:
            run = 0
            in_string = ch == '"'
    return longest


def one(
    base: str,
    model: str,
    case: tuple[str, str, Any, str],
    seed: int,
    max_tokens: int,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """One request of a case: what came back, judged."""
    _name, kind, spec, prompt = case
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    body: dict[str, Any] = {"model": model, "messages": _user(prompt), "max_tokens": max_tokens}
    extra = {k: v for k, v in sampling.items() if k in ("top_k", "min_p")}
    if kind == "object":
        body["temperature"] = 0
    else:
        body["seed"] = seed
        body.update({k: v for k, v in sampling.items() if k not in extra})
        if extra:
            body["extra_body"] = extra
    schema: dict[str, Any]
    if kind == "parse":
        schema = spec.model_json_schema()
        try:
            r = client.chat.completions.parse(response_format=spec, **body)
        except openai.LengthFinishReasonError as exc:
            r = exc.completion
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        ended = finish == "stop"
    elif kind == "tool":
        schema = spec
        r = client.chat.completions.create(
            tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **body
        )
        calls = r.choices[0].message.tool_calls or []
        text = calls[0].function.arguments if calls else (r.choices[0].message.content or "")
        finish = r.choices[0].finish_reason
        ended = finish == "tool_calls" and len(calls) >= 1
    else:
        schema = spec
        fmt: dict[str, Any] = (
            {"type": "json_object"} if kind == "object"
            else {"type": "json_schema", "json_schema": {"name": "City", "strict": True,
                                                          "schema": spec}}
        )  # fmt: skip
        r = client.chat.completions.create(response_format=fmt, **body)  # type: ignore[call-overload]
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        ended = finish == "stop"
    valid = False
    value: Any = None
    with contextlib.suppress(ValueError, jsonschema.ValidationError):
        value = json.loads(text)
        jsonschema.validate(value, schema)
        valid = True
    return {
        "finished": ended and valid,
        "undeclared": value is not None and kind != "object" and undeclared(value, schema, schema),
        "digits": longest_number_part(text),
        "tokens": r.usage.completion_tokens if r.usage else 0,
        "text": text,
    }


def _model_id(base: str) -> str:
    return str(httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"])


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[list[tuple[str, str]]]:
    """(name, base URL) of each server, started here where no URL is given."""
    logs = Path(args.logs)
    logs.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        found: list[tuple[str, str]] = []
        gguf = str(resolve_model(args.model, cache_dir(None, os.environ), progress=print))
        if args.url:
            found.append(("ninfer", args.url.rstrip("/")))
        else:
            port = _free_port()
            cmd = [sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
                   "--threads", str(args.threads), "--no-access-log"]  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(_running(cmd, url, "/ready", logs / "ninfer-structured.log",
                                         dict(os.environ)))  # fmt: skip
            found.append(("ninfer", url))
        llama = None if args.llama_url else find_llama_server(args.llama_server)
        if args.llama_url:
            found.append(("llama-server", args.llama_url.rstrip("/")))
        elif llama is not None:
            port = _free_port()
            cmd = [llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
                   str(args.threads), "-np", "1", "-c", "4096", "--jinja", "--no-repack",
                   "--no-webui"]  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(_running(cmd, url, "/health", logs / "llama-structured.log",
                                         dict(os.environ)))  # fmt: skip
            found.append(("llama-server", url))
        else:
            print("no llama-server (see this file's help): ninfer alone", file=sys.stderr)
        yield found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--url", default=None, help="a running ninfer (else one is started)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary to start")
    ap.add_argument("--llama-url", default=None, help="a running llama-server")
    ap.add_argument("--seeds", type=int, default=25)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument(
        "--sampling",
        choices=["server", "llama"],
        default="server",
        help="each server's default sampling, or llama-server's sent to both",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every answer here")
    ap.add_argument("--logs", default="race-logs", help="directory for the servers' output")
    args = ap.parse_args()
    sampling = LLAMA_SAMPLING if args.sampling == "llama" else {}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with servers(args) as found:
        models = {name: _model_id(url) for name, url in found}
        for case in CASES:
            seeds = 1 if case[1] == "object" else args.seeds
            for seed in range(seeds):
                for name, url in found if seed % 2 == 0 else found[::-1]:
                    row = one(url, models[name], case, seed, args.max_tokens, sampling)
                    results.setdefault(case[0], {}).setdefault(name, []).append(row)
            print(f"{case[0]}: done", file=sys.stderr)
    names = [name for name, _ in found]
    how = "each server's default" if not sampling else json.dumps(sampling)
    print(f"\nmax_tokens {args.max_tokens}, seeds 0-{args.seeds - 1}, sampling: {how}\n")
    print("| case | " + " | ".join(f"{n}: finished / undeclared / runaway / long / tokens"
                                    for n in names) + " |")  # fmt: skip
    print("|---|" + "---|" * len(names))
    totals = {n: [0, 0, 0, 0, 0] for n in names}
    for case, by_server in results.items():
        cells = []
        for n in names:
            rows = by_server[n]
            f = sum(r["finished"] for r in rows)
            u = sum(r["undeclared"] for r in rows)
            w = sum(r["digits"] > 16 for r in rows)
            g = sum(r["digits"] >= 10 for r in rows)
            t = statistics.mean(r["tokens"] for r in rows)
            cells.append(f"{f}/{len(rows)} / {u} / {w} / {g} / {t:.0f}")
            for i, v in enumerate((f, len(rows), u, w, g)):
                totals[n][i] += v
        print(f"| {case} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{f}/{k} / {u} / {w} / {g} / -" for f, k, u, w, g in
                                  (totals[n] for n in names)) + " |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
