"""The KV pool beside other processes: ninfer in a memory cgroup, a neighbour that takes
memory after start-up, and distinct prompts that fill the prefix cache.

    sudo .venv/bin/python benchmarks/kv_memory.py [--model smollm2-135m-instruct]
        [--limit-mib 3072] [--hog-mib 1600] [--prompts 60] [--kv-capacity auto]

It makes a memory cgroup under this process's own (cgroup v1's memory controller, or
v2 where the tree delegates it; root is needed) with --limit-mib, starts `ninfer serve
--kv-capacity auto` (or --kv-capacity) in it, and once the server is ready starts a
neighbour in the same cgroup that takes --hog-mib and holds it. Then it sends
--prompts distinct prompts of ~1,000 tokens, one at a time, and every ten prints the
cgroup's usage, the server's RSS and whether the server and the neighbour are still
alive; at the end the answers that were not 200 and how many processes the cgroup's
OOM killer took. Before ninfer watched the memory left (issue 41), the pool's pages
grew into the neighbour's memory and the OOM killer took the neighbour; the figures
are in docs/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx


def make_cgroup(limit: int) -> tuple[Path, str]:
    """A fresh memory cgroup with `limit` bytes: (its folder, its usage file)."""
    name = f"ninfer-bench-{os.getpid()}"
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").is_file():
        folder = v1 / name
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(limit))
        return folder, "memory.usage_in_bytes"
    own = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
    folder = Path("/sys/fs/cgroup") / own.lstrip("/") / name
    folder.mkdir()
    (folder / "memory.max").write_text(str(limit))
    return folder, "memory.current"


def in_cgroup(folder: Path, argv: list[str]) -> list[str]:
    """`argv` run by a shell that first joins the cgroup."""
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)
    return ["sh", "-c", f"echo $$ > {folder / 'cgroup.procs'} && exec {quoted}"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--limit-mib", type=int, default=3072)
    parser.add_argument("--hog-mib", type=int, default=1600)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--kv-capacity", default="auto")
    parser.add_argument("--port", type=int, default=8941)
    args = parser.parse_args()
    folder, usage_file = make_cgroup(args.limit_mib << 20)
    serve = [sys.executable, "-m", "ninfer", "serve", "--model", args.model, "--port",
             str(args.port), "--kv-capacity", args.kv_capacity]  # fmt: skip
    server = subprocess.Popen(in_cgroup(folder, serve), stderr=subprocess.DEVNULL)
    hog = None
    url = f"http://127.0.0.1:{args.port}"
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            while True:  # polling another process: it has no event to wait on
                try:
                    if c.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            usage = lambda: int((folder / usage_file).read_text())  # noqa: E731
            print(f"ready: cgroup usage {usage() >> 20} MiB of {args.limit_mib} MiB")
            take = f"b = bytearray({args.hog_mib << 20}); import time; time.sleep(3600)"
            hog = subprocess.Popen(in_cgroup(folder, [sys.executable, "-c", take]))
            while usage() < (args.hog_mib << 20):  # the neighbour's memory, taken
                time.sleep(0.1)
            print(f"neighbour in: usage {usage() >> 20} MiB")
            refused = []
            rng = random.Random(0)
            for i in range(1, args.prompts + 1):
                words = " ".join("".join(rng.choices(string.ascii_lowercase, k=6))
                                 for _ in range(300))  # fmt: skip
                try:
                    r = c.post("/v1/generate", json={"prompt": words, "max_new_tokens": 16})
                    if r.status_code != 200:
                        refused.append((i, r.status_code))
                except httpx.TransportError as exc:
                    refused.append((i, type(exc).__name__))
                if i % 10 == 0:
                    alive = server.poll() is None
                    print(f"after {i}: usage {usage() >> 20} MiB, server RSS "
                          f"{rss_kib(server.pid) >> 10 if alive else 0} MiB, server "
                          f"{'alive' if alive else 'gone'}, neighbour "
                          f"{'alive' if hog.poll() is None else 'killed'}")  # fmt: skip
            oom = folder / "memory.oom_control"
            kills = [ln for ln in oom.read_text().splitlines() if ln.startswith("oom_kill ")]
            print(f"not 200: {refused or 'none'}; {kills[0] if kills else 'oom_kill: n/a'}")
    finally:
        for proc in (hog, server):
            if proc is not None:
                proc.kill()
                proc.wait()
        time.sleep(0.5)
        folder.rmdir()


if __name__ == "__main__":
    main()
