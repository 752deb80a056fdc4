"""Identity beside busy neighbours: greedy answers under load, token for token against a
quiet reference.

    .venv/bin/python benchmarks/identity.py [--cpu native|avx2] [--answers 2000]
        [--hogs 2] [--clients 8] [--prompts 40] [--max-tokens 24] [--greedy-share 0.6]
        [--threads 2] [--model NAME|PATH] [--json out.json]

Starts `ninfer serve` (under --cpu avx2, with ATEN_CPU_CAPABILITY=avx2 and the matmul
libraries held to AVX2, as benchmarks/race.py does), then:

1. quiet: each of --prompts fixed prompts (distinct texts, so the prefix cache shares
   little) answered alone, greedily, through /v1/generate: the reference token ids;
2. loaded: --hogs busy processes (a loop on a core each) and --clients clients, each
   sending, in a seeded random order, a greedy request for one of the prompts (its
   answer compared token for token with the reference) or a sampled one (temperature
   0.8, top_p 0.95, a seed of its own, 8 to 48 tokens), --greedy-share of them greedy,
   until --answers greedy answers were compared.

ninfer promises that a request's tokens depend on nothing but the request: not its batch,
its neighbours in a decode step, the prefix cache, the kernels' threads or how busy the
machine is. Prints how many greedy answers were compared and how many differed (with the
first differences), the sampled requests served beside them, the kernels' solo calls
(`ninfer_kernel_solo_calls_total`: the pool gave up its workers under load), and exits 1
on any difference. tests/test_identity.py runs a short version on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, resolve_model
from ninfer.tools._identity import busy_processes, loaded, prompts, reference, solo_calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", choices=["native", "avx2"], default="native")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--answers", type=int, default=2000)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--greedy-share", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gguf = str(resolve_model(args.model, cache_dir(None, os.environ)))
    env = {**os.environ, **(race.AVX2_ENV if args.cpu == "avx2" else {})}
    texts = prompts(args.prompts)
    port = race._free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ninfer", "serve", "--model", gguf, "--port", str(port),
           "--threads", str(args.threads), "--max-concurrency", str(args.clients),
           "--no-access-log"]  # fmt: skip
    log = Path("race-logs")
    log.mkdir(exist_ok=True)
    with race._running(cmd, url, "/ready", log / f"ninfer-identity-{args.cpu}.log", env):
        began = time.monotonic()
        want = trio.run(reference, url, texts, args.max_tokens)
        quiet_s = time.monotonic() - began
        solo0 = solo_calls(url)
        began = time.monotonic()
        with busy_processes(args.hogs):
            outcome = trio.run(lambda: loaded(
                url, texts, want, answers=args.answers, clients=args.clients,
                max_tokens=args.max_tokens, greedy_share=args.greedy_share,
            ))  # fmt: skip
        loaded_s = time.monotonic() - began
        solo = solo_calls(url) - solo0
    result = {"cpu": args.cpu, "hogs": args.hogs, "clients": args.clients,
              "prompts": args.prompts, "max_tokens": args.max_tokens,
              "compared": outcome.compared, "differed": outcome.differed,
              "sampled": outcome.sampled, "solo_calls": solo,
              "quiet_s": round(quiet_s, 1), "loaded_s": round(loaded_s, 1),
              "first_differences": outcome.first_differences}  # fmt: skip
    print(f"--cpu {args.cpu}: {outcome.compared} greedy answers compared with the quiet "
          f"reference beside {args.hogs} busy processes and {outcome.sampled} sampled "
          f"requests ({args.clients} clients, {loaded_s:.0f} s): {outcome.differed} "
          f"differed; the kernels' pool ran {solo:.0f} calls solo")  # fmt: skip
    for d in outcome.first_differences:
        print(f"  prompt {d['prompt']}: first differs at token {d['first_token_differing']}")
    line = json.dumps(result)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 1 if outcome.differed else 0


if __name__ == "__main__":
    sys.exit(main())
