"""Hang guards whose verdict does not depend on how fast the machine is.

A guard on elapsed wall time trips where a busy machine gives the test a fifth of a
core, or a slow one takes five times as long, though nothing hangs. These guards watch
what a hang stops instead: the process's CPU time (every thread's: the engine, the
kernels' pool, the event loop). A deadlock stops it; a machine that is merely busy or
slow only slows it. A guard trips when the process has used less than PROGRESS_CPU_S
of CPU over STALL_S of wall time (stalled), or more than CPU_BUDGET_S in all (a
livelock: a thread spinning forever), never on elapsed time alone.

- `hang_guard()` around a block of Trio code: the block is cancelled and
  `trio.TooSlowError` raised when the guard trips;
- `wait_until(wait)` for a thread: `wait(seconds)` (an Event's or a Condition's wait)
  is called until it says yes, or the guard trips (False).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

# A stretch of wall time in which a process that is not hung uses at least
# PROGRESS_CPU_S of CPU: an idle server waiting on its sockets uses ~0.001 s in it; a
# machine so busy that a working test gets less than a thousandth of a core is not one
# a test can run on.
STALL_S = 120.0
PROGRESS_CPU_S = 0.1
# All the CPU one guarded block may use: the longest real-model block uses ~60 s here.
CPU_BUDGET_S = 1800.0
POLL_S = 1.0


class Progress:
    """The process's CPU time as a guard reads it."""

    def __init__(self) -> None:
        self.began = self.mark = time.process_time()
        self.mark_at = time.monotonic()

    def stalled(self) -> str | None:
        """Why the process looks hung (None: it does not)."""
        cpu, now = time.process_time(), time.monotonic()
        if cpu - self.began > CPU_BUDGET_S:
            return f"{cpu - self.began:.0f} s of CPU used (a livelock?)"
        if cpu - self.mark >= PROGRESS_CPU_S:
            self.mark, self.mark_at = cpu, now
        elif now - self.mark_at > STALL_S:
            return f"no progress for {now - self.mark_at:.0f} s ({cpu - self.mark:.3f} s of CPU)"
        return None


def wait_until(wait: Callable[[float], bool]) -> bool:
    """`wait(POLL_S)` until it returns True (True), or the guard trips (False)."""
    progress = Progress()
    while not wait(POLL_S):
        if progress.stalled() is not None:
            return False
    return True


@contextmanager
def hang_guard() -> Iterator[None]:
    """Cancel the enclosed Trio code and raise trio.TooSlowError if the process stalls
    or spins (module docstring). A watcher thread reads the process's CPU time."""
    token = trio.lowlevel.current_trio_token()
    done = threading.Event()
    why: list[str] = []
    with trio.CancelScope() as scope:

        def watch() -> None:
            progress = Progress()
            while not done.wait(POLL_S):
                stalled = progress.stalled()
                if stalled is not None:
                    why.append(stalled)
                    token.run_sync_soon(scope.cancel)
                    return

        watcher = threading.Thread(target=watch, name="hang-guard", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
    if scope.cancelled_caught and why:
        raise trio.TooSlowError(f"hang guard: {why[0]}")
