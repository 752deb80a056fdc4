"""The harness's hang guards (tests/hangguard.py) trip on what a hang stops, the
process's CPU progress, never on elapsed time: a stalled block is cancelled, a block
that works slowly is not, and one that spins past its CPU budget is. The guard's
figures are shrunk here so that each case takes a few seconds."""

from __future__ import annotations

import threading
import time

import hangguard
import pytest
import trio
from hangguard import hang_guard, wait_until


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hangguard, "STALL_S", 1.5)
    monkeypatch.setattr(hangguard, "POLL_S", 0.1)


def _spin(seconds: float) -> None:
    """Keep a core busy for `seconds` of wall time (a slow machine's working test)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


async def test_a_stalled_block_is_cancelled(quick: None) -> None:
    """Waiting for an event nobody sets uses no CPU: the guard cancels the wait."""
    never = trio.Event()
    with pytest.raises(trio.TooSlowError, match="no progress"), hang_guard():
        await never.wait()


async def test_a_working_block_runs_past_the_stall_time(quick: None) -> None:
    """Work that takes twice the stall time (on a thread, as the engine works) is not
    cancelled: the process makes progress all along."""
    with hang_guard():
        await trio.to_thread.run_sync(_spin, 3.0)


async def test_a_block_spinning_past_its_budget_is_cancelled(
    quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread spinning for ever (a livelock) uses CPU without end: the budget trips."""
    monkeypatch.setattr(hangguard, "CPU_BUDGET_S", 0.5)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        with pytest.raises(trio.TooSlowError, match="livelock"), hang_guard():
            await trio.Event().wait()
    finally:
        stop.set()
        thread.join()


def test_a_thread_waits_while_there_is_progress_and_gives_up_on_a_stall(quick: None) -> None:
    """`wait_until` waits as long as the process works (here a worker thread spinning
    past the stall time before it sets the event), and gives up on an event nobody sets
    once nothing works."""
    done = threading.Event()

    def work() -> None:
        _spin(3.0)
        done.set()

    threading.Thread(target=work, daemon=True).start()
    assert wait_until(done.wait)
    assert not wait_until(threading.Event().wait)
