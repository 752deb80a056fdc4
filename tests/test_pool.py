"""The kernels' thread pool (ninfer/engine/csrc/pool.h) under stress, as its publish
protocol promises: no call returns before each of its tasks has finished, no task runs
twice or under another call, a kernel's outputs are the same bits on the pool as on one
thread, and ThreadSanitizer finds no access the protocol leaves unordered. Short runs of
tests/native/pool_stress.cpp beside busy processes, with more pool threads than cores;
`./dev.sh pool-stress` runs the long ones (docs/engine.md gives the last result)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S
from poolstress import build, built_library, run

CORES = os.cpu_count() or 1


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module's builds (each build's plain kernels compiled once)."""
    return tmp_path_factory.mktemp("pool-stress")


@pytest.mark.parametrize(
    ("build_name", "calls", "kernel_calls"),
    [("optimized", 300_000, 2_000), ("tsan", 40_000, 300)],
)
def test_pool_stress_is_clean_beside_busy_processes(
    build_name: str, calls: int, kernel_calls: int, builds: Path
) -> None:
    """Every call's tasks ran exactly once and had finished when run() returned; every
    kernel output equals one thread's (and, in the ThreadSanitizer build, no report)."""
    # the optimized build links the kernels as built for the suite (./dev.sh builds them)
    exe = build(build_name, builds, library=built_library())
    if isinstance(exe, str):
        # the compiler that builds the kernels builds the plain program: its failure is
        # the program's (or the kernels' interface's) defect, never a reason to skip
        assert build_name == "tsan" or exe == "no C++ compiler found", exe
        if "build failed" in exe:
            pytest.skip(f"no ThreadSanitizer runtime for this compiler: {exe}")
        pytest.skip(exe)
    # The program's own guard is the count of calls; the hang guard is for a pool that
    # never returns (sized for a machine many times slower than a quiet 2-core one).
    outcome = run(exe, build_name, calls=calls, kernel_calls=kernel_calls,
                  threads=CORES + 1, busy=CORES, timeout_s=10 * HANG_GUARD_S)  # fmt: skip
    assert outcome.returncode == 0, outcome.output
    assert f"calls {calls} " in outcome.output
    assert "early 0 double 0 foreign 0" in outcome.output
    assert f"kernel calls {kernel_calls}: wrong 0" in outcome.output
    assert "ThreadSanitizer" not in outcome.output


def test_the_stress_program_finds_a_racy_pool(builds: Path, tmp_path: Path) -> None:
    """The stress program can fail: a pool whose worker compares its task index with a
    task count written apart from the call's generation (the race the publish protocol
    closes) is caught by ThreadSanitizer on the first calls that overlap."""
    racy = tmp_path / "racy"
    racy.mkdir()
    source = (Path(__file__).parents[1] / "ninfer/engine/csrc/pool.h").read_text()
    # plant the old protocol's flaw: the count read from a plain field, not from the word
    planted = (
        source.replace(
            "if (task >= static_cast<uint32_t>((c >> COUNT_BITS) & COUNT_MASK)) return;",
            "if (task >= static_cast<uint32_t>(racy_tasks_)) return;",
        )
        .replace("    fn_ = &fn;\n", "    fn_ = &fn;\n    racy_tasks_ = tasks;\n")
        .replace("  int spin_us_ = 100;\n", "  int spin_us_ = 100;\n  int racy_tasks_ = 0;\n")
    )
    assert planted.count("racy_tasks_") == 3
    (racy / "pool.h").write_text(planted)
    exe = build("tsan", builds, include=racy)
    if isinstance(exe, str):
        pytest.skip(exe)
    outcome = run(exe, "tsan", calls=10_000, kernel_calls=0, threads=CORES + 1, busy=CORES,
                  timeout_s=10 * HANG_GUARD_S)  # fmt: skip
    assert outcome.returncode != 0
    assert "ThreadSanitizer: data race" in outcome.output
    assert "racy_tasks_" in outcome.output or "pool.h" in outcome.output
