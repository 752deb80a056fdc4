"""Does a client that honours Retry-After get in when it is told? Measured against ninfer.

    .venv/bin/python benchmarks/retry_after.py [--model NAME|PATH] [--levels 2,10]
        [--duration-s 40] [--max-tokens 32] [--max-concurrency 4] [--max-pending 4]
        [--threads 2] [--token] [--poller none|token|clock|sdk] [--squatters 0.25]
        [--one-address] [--json out.json]

Starts `ninfer serve` on a loopback port, then for each level runs level x capacity
clients (capacity = max concurrency + max pending) in a closed loop for --duration-s:
each sends a chat completion of a fixed output length (ignore_eos), and on a 429 waits
exactly `retry-after-ms` (as the official SDKs do) and sends it again, until it is let
in. The clients send no `x-stainless-retry-count`: the server cannot tell a return
from a newcomer except by the clock (the worst case for it). A chain that began
before the level's end is followed until it is let in.

What is measured is what the client lives: for each request refused at least once,
when it was first refused, what it was told then, how many times it came back, and
when it was really let in (the moment it sent the attempt that was not refused).
Prints, per level, how many were let in at their first return, their second, and
later, and the error |told - real| (median, p90, worst; real = the wait from the
first refusal to the attempt let in); the last line is JSON. The targets (issue 28):
everyone in at the first or second return; median error under 1 s at 2x and under
10% of the median wait at 10x.

Who games it (issue 41): --token makes the clients speak `ninfer-retry-token`;
--poller adds one client that retries 0.1 s after every 429 (with its token, without,
or without and saying it retries); --squatters makes that fraction of the clients give
up after each 429 (their promise unclaimed) and send a new request after the told
wait. It prints how many requests each role's clients were served (mean per client);
the chains and waits above are the obedient clients' only; and the occupancy: the mean
of /metrics' running requests over the level (sampled every 0.25 s) as a share of
--max-concurrency. Not part of the test suite.

Each client sends from an address of its own (127.0.0.2, 127.0.0.3, ...: Linux routes
all of 127/8 to loopback), as clients on separate hosts would: the server knows a
client without a token by its address (docs/scheduler.md, "Clients"). --one-address
sends them all from 127.0.0.1 instead (many users behind one address).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from race import _free_port, _running

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model


@attrs.frozen
class Chain:
    """One request refused at least once, followed until it was let in."""

    told: float  # seconds the first refusal said
    real: float  # seconds from the first refusal to the attempt that was let in
    returns: int  # attempts after the first, the one let in included


async def _level(
    url: str, clients: int, args: argparse.Namespace
) -> tuple[list[Chain], int, dict[str, list[int]], float]:
    """Run the closed loop; return every obedient client's refused requests' chains,
    how many requests they were served, how many each client of each role was, and the
    occupancy."""
    chains: list[Chain] = []
    served = 0
    squatters = round(args.squatters * clients)
    roles = ["obedient"] * (clients - squatters) + ["squatter"] * squatters
    if args.poller != "none":
        roles.append("poller")
    by_role: dict[str, list[int]] = {role: [] for role in roles}
    stop_at = trio.current_time() + args.duration_s
    body = {
        "model": args.model_id,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    running: list[float] = []

    async def client(role: str, address: str) -> None:
        nonlocal served
        mine = 0
        # Who speaks tokens: obedient clients and squatters with --token, the poller
        # with --poller token.
        speaks = args.poller == "token" if role == "poller" else args.token
        transport = httpx.AsyncHTTPTransport(local_address=address)
        async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as http:
            while trio.current_time() < stop_at:
                first: tuple[float, float] | None = None  # (refused at, told)
                attempts = 0
                token = "new" if speaks else None
                while True:
                    sent = trio.current_time()
                    headers = {}
                    if token is not None:
                        headers["ninfer-retry-token"] = token
                    if role == "poller" and args.poller == "sdk" and attempts:
                        headers["x-stainless-retry-count"] = str(attempts)
                    r = await http.post("/v1/chat/completions", json=body, headers=headers)
                    if r.status_code not in (429, 503):
                        r.raise_for_status()
                        break
                    told = int(r.headers["retry-after-ms"]) / 1000
                    if speaks:
                        token = r.headers.get("ninfer-retry-token", token)
                    if first is None:
                        first = (trio.current_time(), told)
                    attempts += 1
                    if role == "squatter":  # gives up; a new request after the wait
                        token = "new" if speaks else None
                        first, attempts = None, 0
                    await trio.sleep(0.1 if role == "poller" else told)
                mine += 1
                if role == "obedient":
                    served += 1
                    if first is not None:
                        chains.append(Chain(told=first[1], real=sent - first[0], returns=attempts))
        by_role[role].append(mine)

    async def occupancy() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
            while trio.current_time() < stop_at:
                text = (await probe.get("/metrics")).text
                line = next(x for x in text.splitlines()
                            if x.startswith("ninfer_num_requests_running "))  # fmt: skip
                running.append(float(line.split()[1]))
                await trio.sleep(0.25)

    async with trio.open_nursery() as n:
        n.start_soon(occupancy)
        for i, role in enumerate(roles):
            address = "127.0.0.1" if args.one_address else f"127.0.{i // 250}.{2 + i % 250}"
            n.start_soon(client, role, address)
    share = statistics.mean(running) / args.max_concurrency if running else 0.0
    return chains, served, by_role, share


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


def _row(
    level: float, clients: int, chains: list[Chain], served: int, span: float
) -> dict[str, Any]:
    errs = sorted(abs(c.told - c.real) for c in chains)
    real = [c.real for c in chains]
    return {
        "level": level,
        "clients": clients,
        "served": served,
        "served_per_s": served / span,
        "refused_requests": len(chains),
        "in_at_first_return": sum(c.returns == 1 for c in chains),
        "in_at_second_return": sum(c.returns == 2 for c in chains),
        "in_later": sum(c.returns > 2 for c in chains),
        "most_returns": max((c.returns for c in chains), default=0),
        "real_wait_median_s": statistics.median(real) if real else None,
        "told_median_s": statistics.median(c.told for c in chains) if chains else None,
        "abs_error_median_s": statistics.median(errs) if errs else None,
        "abs_error_p90_s": errs[int(0.9 * (len(errs) - 1))] if errs else None,
        "abs_error_worst_s": errs[-1] if errs else None,
    }


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
    ap.add_argument(
        "--token",
        action="store_true",
        help="clients send ninfer-retry-token (new, then the token given)",
    )
    ap.add_argument(
        "--poller",
        choices=["none", "token", "clock", "sdk"],
        default="none",
        help="one more client that retries 0.1 s after every 429: with its "
        "token, without, or without and with x-stainless-retry-count",
    )
    ap.add_argument("--one-address", action="store_true",
                    help="every client from 127.0.0.1 (else each from its own loopback "
                    "address, as separate hosts)")  # fmt: skip
    ap.add_argument("--squatters", type=float, default=0.0,
                    help="this fraction of the clients gives up after each 429 and sends "
                    "a new request after the wait it was told")  # fmt: skip
    args = ap.parse_args()
    model_path = resolve_model(args.model, cache_dir(None, {}), progress=print)
    capacity = args.max_concurrency + args.max_pending
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "ninfer", "serve", "--model", str(model_path),
            "--port", str(port), "--threads", str(args.threads),
            "--max-concurrency", str(args.max_concurrency),
            "--max-pending-requests", str(args.max_pending),
            "--pending-timeout-ms", "600000", "--model-id", "bench",
        ]  # fmt: skip
        args.model_id = "bench"
        with _running(cmd, url, "/ready", Path(tmp) / "server.out"):
            # one request first, so that the engine has measured its pace
            httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_new_tokens": 8},
                       timeout=120).raise_for_status()  # fmt: skip
            for level in (float(x) for x in args.levels.split(",")):
                clients = max(1, round(level * capacity))
                began = time.monotonic()
                chains, served, by_role, occupancy = trio.run(_level, url, clients, args)
                row = {**_row(level, clients, chains, served, time.monotonic() - began),
                       **_pace(url)}  # fmt: skip
                row["served_by_role"] = by_role
                row["occupancy"] = occupancy
                results.append(row)
                each = ", ".join(f"{role} {statistics.mean(n):.1f} (of {len(n)})"
                                 for role, n in by_role.items())  # fmt: skip
                print(f"served per client: {each}; occupancy {occupancy:.2f}", flush=True)
                print(
                    f"{level:g}x capacity ({clients} clients): {served} served "
                    f"({row['served_per_s']:.2f}/s), {len(chains)} refused at least once; "
                    f"let in at the first return {row['in_at_first_return']}, the second "
                    f"{row['in_at_second_return']}, later {row['in_later']} (most returns "
                    f"{row['most_returns']}); real wait median "
                    f"{row['real_wait_median_s'] or 0:.2f} s, told median "
                    f"{row['told_median_s'] or 0:.2f} s; |told - real| median "
                    f"{row['abs_error_median_s'] or 0:.3f} s, p90 "
                    f"{row['abs_error_p90_s'] or 0:.3f} s, worst "
                    f"{row['abs_error_worst_s'] or 0:.3f} s; the engine's pace "
                    f"{row['decode_step_s']:.4f} s a step",
                    flush=True,
                )
    line = json.dumps({"capacity": capacity, "max_tokens": args.max_tokens, "levels": results})
    if args.json:
        args.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
