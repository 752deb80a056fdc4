"""The admission scheduler, in virtual time (autojump clock), with no engine at all."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
import trio.testing

from scheduler import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    AdmissionController,
    Overloaded,
    Ticket,
)


async def test_capacity_is_running_plus_pending_and_refuses_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctl = AdmissionController(max_running=2, max_pending=3, units_total=100)
    tickets = [ctl.enter() for _ in range(5)]
    t0 = trio.current_time()
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert trio.current_time() == t0, "refusal is immediate"
    assert e.value.retry_after >= 1
    tickets[0].release()
    ctl.enter()  # a place came back
    assert ctl.statistics().rejected_total == 1


async def test_fifo_order_and_slots(autojump_clock: trio.testing.MockClock) -> None:
    ctl = AdmissionController(max_running=1, max_pending=10, units_total=100)
    order: list[int] = []
    first = ctl.enter()
    await ctl.admit(first, 1)

    async def waiter(i: int, task_status: trio.TaskStatus[None]) -> None:
        with ctl.enter() as t:
            task_status.started()
            await ctl.admit(t, 1)
            order.append(i)
            await trio.sleep(1)

    async with trio.open_nursery() as n:
        for i in range(5):
            await n.start(waiter, i)
        await trio.testing.wait_all_tasks_blocked()
        assert ctl.statistics().waiting == 5
        first.release()
    assert order == [0, 1, 2, 3, 4]
    stats = ctl.statistics()
    assert (stats.in_system, stats.running, stats.units_used) == (0, 0, 0)


async def test_deadline_ends_the_wait(autojump_clock: trio.testing.MockClock) -> None:
    ctl = AdmissionController(max_running=1, max_pending=1, units_total=10)
    busy = ctl.enter()
    await ctl.admit(busy, 1)
    t = ctl.enter()
    deadline = trio.current_time() + 5.0
    with trio.move_on_at(deadline) as scope:
        await ctl.admit(t, 1)
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(deadline)
    assert ctl.statistics().waiting == 0, "a timed-out waiter leaves the queue"
    t.release()
    assert ctl.statistics().in_system == 1


async def test_disconnect_while_queued_frees_the_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctl = AdmissionController(max_running=1, max_pending=1, units_total=10)
    busy = ctl.enter()
    await ctl.admit(busy, 1)
    admitted: list[str] = []
    async with trio.open_nursery() as n:
        scope = trio.CancelScope()

        async def client() -> None:
            with scope, ctl.enter() as t:
                await ctl.admit(t, 1)
                admitted.append("never")

        n.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        assert ctl.statistics().waiting == 1
        with pytest.raises(Overloaded):
            ctl.enter()
        scope.cancel()
    assert admitted == []
    stats = ctl.statistics()
    assert (stats.waiting, stats.in_system) == (0, 1)
    ctl.enter()  # the place is free again


async def test_head_of_line_waits_for_units_and_blocks_those_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctl = AdmissionController(max_running=4, max_pending=4, units_total=10)
    big_holder = ctl.enter()
    await ctl.admit(big_holder, 8)
    order: list[str] = []

    async def want(name: str, units: int) -> None:
        with ctl.enter() as t:
            await ctl.admit(t, units)
            order.append(name)
            await trio.sleep(10)

    async with trio.open_nursery() as n:
        n.start_soon(want, "large", 5)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(want, "small", 1)  # would fit now, but must not overtake
        await trio.testing.wait_all_tasks_blocked()
        assert order == []
        assert ctl.statistics().units_free == 2
        big_holder.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(order) == ["large", "small"]
        assert ctl.statistics().units_used == 6


async def test_a_ticket_of_several_sequences_holds_a_slot_for_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """n choices decode as n rows: a ticket admitted with 3 slots leaves 1 of 4, and one
    asking for 2 waits (in FIFO order) until the 3 come back together."""
    ctl = AdmissionController(max_running=4, max_pending=4, units_total=100)
    three = ctl.enter()
    await ctl.admit(three, 3, slots=3)
    assert ctl.statistics().running == 3
    admitted: list[str] = []

    async def want(name: str, slots: int) -> None:
        with ctl.enter() as t:
            await ctl.admit(t, 1, slots=slots)
            admitted.append(name)
            await trio.sleep(10)

    async with trio.open_nursery() as n:
        n.start_soon(want, "two", 2)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(want, "one", 1)  # would fit, but must not overtake
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == []
        three.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(admitted) == ["one", "two"]
        assert ctl.statistics().running == 3
    assert not ctl.fits(1, slots=5)
    with ctl.enter() as t, pytest.raises(ValueError, match="never be granted"):
        await ctl.admit(t, 1, slots=5)


async def test_units_that_can_never_fit_are_refused() -> None:
    ctl = AdmissionController(max_running=1, max_pending=1, units_total=10)
    assert not ctl.fits(11)
    with ctl.enter() as t, pytest.raises(ValueError, match="never be granted"):
        await ctl.admit(t, 11)


async def test_retry_after_follows_the_drain_rate(autojump_clock: trio.testing.MockClock) -> None:
    ctl = AdmissionController(max_running=1, max_pending=0, units_total=10)
    for _ in range(5):
        with ctl.enter() as t:
            await ctl.admit(t, 1)
            await trio.sleep(4.0)  # one completion every 4 virtual seconds
    assert ctl.drain_rate() == pytest.approx(0.25)
    holder = ctl.enter()
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == pytest.approx(4.0)  # no service times given: the drain rate
    holder.release()


# ---- retry estimates from the caller's service times ------------------------------------


def _by_tag(tickets: Sequence[Ticket]) -> list[float]:
    return [_one_by_tag(t) for t in tickets]


def _one_by_tag(ticket: Ticket) -> float:
    """The test's service time: the tag is (admitted at, seconds it runs); a ticket
    with no tag is unknown (nothing is assumed of it)."""
    if ticket.tag is None:
        return 0.0
    assert isinstance(ticket.tag, tuple)
    started, seconds = ticket.tag
    if ticket.admitted:
        return started + seconds - trio.current_time()
    return float(seconds)


async def test_refusals_together_are_told_successive_places(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two running (ending in 3 s and 5 s) and one queued (4 s once it runs): places
    free at 3, 5 and 7 s, and each is taken again by a request like the one waiting
    (4 s), so the fourth frees at 9 s. Refusals made together are told those in turn;
    later refusals queue behind the places already promised, until places really come
    back."""
    ctl = AdmissionController(max_running=2, max_pending=1, units_total=10, service_time=_by_tag)
    now = trio.current_time()
    a, b, c = ctl.enter(), ctl.enter(), ctl.enter()
    a.tag, b.tag, c.tag = (now, 3.0), (now, 5.0), (None, 4.0)
    await ctl.admit(a, 1)
    await ctl.admit(b, 1)

    def refuse(n: int) -> list[float]:
        told = []
        for _ in range(n):
            with pytest.raises(Overloaded) as e:
                ctl.enter()
            told.append(e.value.retry_after)
        return told

    async with trio.open_nursery() as n:
        n.start_soon(ctl.admit, c, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert refuse(4) == pytest.approx([3.0, 5.0, 7.0, 9.0])
        # Two seconds on, the four refused are still waiting: the next one is told the
        # fifth place, which frees 11 s after the start (9 s from now).
        await trio.sleep(2.0)
        assert refuse(1) == pytest.approx([9.0])
        # Time alone keeps no promise: only places that come back do.
        await trio.sleep(20.0)
        assert refuse(1) == [ctl.place_free_in(6)]
        a.release()  # one place back (c is admitted into a's slot), and taken again:
        c.tag = (trio.current_time(), 4.0)
        x = ctl.enter()
        assert refuse(1) == [ctl.place_free_in(6)]  # 7 promised, 1 back
        x.release()
        for _ in range(6):  # six more come back: every promise is kept
            ctl.enter().release()
        x = ctl.enter()
        assert refuse(1) == [ctl.place_free_in(1)]
        x.release()
        n.cancel_scope.cancel()


async def test_a_queue_held_by_units_frees_places_in_fifo_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The head of the queue needs units that only free when both running requests
    end: the estimate follows the scheduler's own rule (no overtaking)."""
    ctl = AdmissionController(max_running=3, max_pending=1, units_total=10, service_time=_by_tag)
    now = trio.current_time()
    r1, r2 = ctl.enter(), ctl.enter()
    r1.tag, r2.tag = (now, 2.0), (now, 6.0)
    await ctl.admit(r1, 4)
    await ctl.admit(r2, 4)
    big, small = ctl.enter(), ctl.enter()
    big.tag, small.tag = (None, 10.0), (None, 1.0)
    async with trio.open_nursery() as n:
        n.start_soon(ctl.admit, big, 9)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(ctl.admit, small, 1)
        await trio.testing.wait_all_tasks_blocked()
        # r1 ends at 2, r2 at 6; big starts at 6 (ends 16) and small with it (ends 7);
        # the requests that take the freed places again (5 units, like those waiting)
        # cannot start beside big before it ends.
        told = []
        for _ in range(4):
            with pytest.raises(Overloaded) as e:
                ctl.enter()
            told.append(e.value.retry_after)
        assert told == pytest.approx([2.0, 6.0, 7.0, 16.0])
        # A request for one unit joining the queue now would start when small ends, at
        # 7 s; one needing none would fit beside big and small at 6 s.
        assert ctl.admitted_in(1) == pytest.approx(7.0)
        assert ctl.admitted_in(0) == pytest.approx(6.0)
        n.cancel_scope.cancel()


async def test_estimates_are_clamped_to_the_documented_range(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctl = AdmissionController(max_running=1, max_pending=0, units_total=10, service_time=_by_tag)
    t = ctl.enter()
    t.tag = (trio.current_time(), 3600.0)
    await ctl.admit(t, 1)
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == RETRY_AFTER_MAX_S
    t.tag = (trio.current_time() - 3600.0, 3600.0)  # finished, not yet released
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == RETRY_AFTER_MIN_S
