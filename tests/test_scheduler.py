"""The admission scheduler, in virtual time (autojump clock), with no engine at all."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from scheduler import AdmissionController, Overloaded


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
    assert e.value.retry_after == 4
    holder.release()
