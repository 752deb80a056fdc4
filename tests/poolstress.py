"""The kernels' pool under stress: builds tests/native/pool_stress.cpp with the system's
compiler (optimized, and with ThreadSanitizer) against the package's own pool.h and plain
kernels, and runs it beside busy processes with more pool threads than cores.

Used by tests/test_pool.py (a short run of each build) and by `./dev.sh pool-stress`
(the long one: 50 million calls optimized, a million under ThreadSanitizer). Run as a
program: `python tests/poolstress.py [--calls N] [--tsan-calls N] [--busy N]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "ninfer" / "engine" / "csrc"
PROGRAM = Path(__file__).resolve().parent / "native" / "pool_stress.cpp"
# The kernels' own flags where they matter to the numbers (ninfer/engine/_kernels.py).
FLAGS = ["-std=c++17", "-pthread", "-ffp-contract=off", "-fno-math-errno"]
BUILDS = {
    "optimized": ["-O2"],
    # -O1 -g: ThreadSanitizer's advice (usable speed, exact lines in its reports)
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
}


@attrs.frozen
class Outcome:
    build: str
    returncode: int
    output: str
    seconds: float


def compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def built_library() -> Path | None:
    """The package's kernels library as `ninfer build-kernels` built it, if it is."""
    from ninfer._artifacts import cache_dir
    from ninfer.engine._kernels import find_built

    return find_built(cache_dir(None, os.environ))


def build(build_name: str, out_dir: Path, include: Path | None = None,
          library: Path | None = None) -> Path | str:  # fmt: skip
    """The program built as `build_name` in out_dir, or why it could not be (`include`:
    a folder whose headers are taken before the package's: a test's planted pool.h).
    The optimized build given the package's built `library` links its plain kernels,
    as shipped; otherwise the plain kernels are compiled once a build into out_dir (the
    ThreadSanitizer build always: its kernels' accesses are instrumented) and linked
    from there."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found"
    flags = [*BUILDS[build_name], *FLAGS, *(f"-I{d}" for d in (include, CSRC) if d is not None)]
    exe = out_dir / f"pool_stress_{build_name}{'_' + include.name if include else ''}"
    if build_name == "optimized" and library is not None:
        # the library's own plain build (30 s of a 2-core machine's compiling saved); it
        # loads torch's libraries, which the rpath it was linked with finds
        steps = [[cxx, *flags, "-o", str(exe), str(PROGRAM), str(library),
                  f"-Wl,-rpath,{library.parent}"]]  # fmt: skip
    else:
        kernels = out_dir / f"isa_default_{build_name}.o"
        # The kernels' object without -g: its debug information tripled the
        # ThreadSanitizer build (49 s against 16 on 2 cores); a report in them still
        # names the function, and the program (pool.h with it) keeps -g for its lines.
        plain = [f for f in flags if f != "-g"]
        steps = [[cxx, *plain, "-c", str(CSRC / "isa_default.cpp"), "-o", str(kernels)]]
        if kernels.exists():
            steps = []
        steps.append([cxx, *flags, "-o", str(exe), str(PROGRAM), str(kernels)])
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            return f"{build_name} build failed: {tail}"
    return exe


def run(exe: Path, build_name: str, *, calls: int, kernel_calls: int, threads: int, busy: int,
        seed: int = 1, timeout_s: float) -> Outcome:  # fmt: skip
    """One run; ThreadSanitizer's reports make it fail (exit 66) like a counted error."""
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66 second_deadlock_stack=1")
    started = time.perf_counter()
    done = subprocess.run(
        [str(exe), str(calls), str(kernel_calls), str(threads), str(busy), "100", str(seed)],
        capture_output=True, text=True, check=False, timeout=timeout_s, env=env,
    )  # fmt: skip
    return Outcome(build_name, done.returncode, (done.stdout + done.stderr).strip(),
                   time.perf_counter() - started)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50_000_000, help="optimized build's pool calls")
    p.add_argument("--kernel-calls", type=int, default=200_000,
                   help="optimized build's kernel calls")  # fmt: skip
    p.add_argument("--tsan-calls", type=int, default=1_000_000,
                   help="ThreadSanitizer build's pool calls")  # fmt: skip
    p.add_argument("--tsan-kernel-calls", type=int, default=5_000)
    p.add_argument("--threads", type=int, default=cores + 1, help="pool threads (cores + 1)")
    p.add_argument("--busy", type=int, default=cores, help="busy processes beside it (cores)")
    args = p.parse_args(argv)
    failed = False
    with tempfile.TemporaryDirectory(prefix="ninfer-pool-stress-") as tmp:
        runs = [("optimized", args.calls, args.kernel_calls),
                ("tsan", args.tsan_calls, args.tsan_kernel_calls)]  # fmt: skip
        library = built_library()
        for name, calls, kernel_calls in runs:
            exe = build(name, Path(tmp), library=library)
            if isinstance(exe, str):
                print(exe)
                failed = True
                continue
            outcome = run(exe, name, calls=calls, kernel_calls=kernel_calls,
                          threads=args.threads, busy=args.busy, timeout_s=24 * 3600)  # fmt: skip
            verdict = "clean" if outcome.returncode == 0 else f"FAILED (exit {outcome.returncode})"
            print(f"{name}: {verdict} in {outcome.seconds:.0f} s\n{outcome.output}")
            failed = failed or outcome.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
