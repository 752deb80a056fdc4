"""The admission scheduler, in virtual time (autojump clock), with no engine at all."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
import trio.testing

from scheduler import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    TOKEN_GRACE_S,
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
    tickets[0].release()  # a place came back: it is held for the refused caller
    with pytest.raises(Overloaded):
        ctl.enter()  # a newcomer waits behind the promise
    await trio.sleep_until(t0 + e.value.retry_after)
    ctl.enter()  # the refused caller, back at its moment
    assert ctl.statistics().rejected_total == 2
    assert ctl.statistics().promises_kept_total == 1


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
        with pytest.raises(Overloaded) as e:
            ctl.enter()
        refused_at = trio.current_time()
        scope.cancel()
    assert admitted == []
    stats = ctl.statistics()
    assert (stats.waiting, stats.in_system) == (0, 1)
    await trio.sleep_until(refused_at + e.value.retry_after)
    ctl.enter()  # the place is free again, for the caller refused above


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
    ctl = AdmissionController(
        max_running=1, max_pending=0, units_total=10, margin=0.0, margin_fraction=0.0
    )
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
    ctl = _exact(max_running=2, max_pending=1, units_total=10)
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
        n.cancel_scope.cancel()


def _exact(*, unknown: float = 0.0, **kwargs: int) -> AdmissionController:
    """A controller that tells its estimates as they are (no margin on promises); a
    request it knows nothing of is assumed to take `unknown` seconds."""

    def service(tickets: Sequence[Ticket]) -> list[float]:
        return [_one_by_tag(t) if t.tag is not None else unknown for t in tickets]

    return AdmissionController(**kwargs, service_time=service, margin=0.0, margin_fraction=0.0)


async def _one_running(
    *, unknown: float, seconds: float
) -> tuple[AdmissionController, float, Ticket]:
    """An exact controller of one slot and no queue (requests of unknown size take
    `unknown` s), with a request admitted now that will end in `seconds`."""
    ctl = _exact(max_running=1, max_pending=0, units_total=10, unknown=unknown)
    t0 = trio.current_time()
    a = ctl.enter()
    a.tag = (t0, seconds)
    await ctl.admit(a, 1)
    return ctl, t0, a


async def test_a_promised_place_is_held_for_the_caller_that_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot, no queue; the request in it will end in 3 s. A refused caller is
    promised that place; the place comes back early (at 1 s) and is held: a newcomer is
    refused, and told when the promised caller's request (like the last one, 3 s) will
    be done; the promised caller, back at 3 s, gets in. Promises are kept in order, a
    caller back before its place is back keeps its turn, and an unclaimed promise lapses
    after the grace period."""
    ctl, t0, a = await _one_running(unknown=3.0, seconds=3.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == pytest.approx(3.0)
    await trio.sleep(1.0)
    a.release()
    assert ctl.statistics().promises_held == 1
    with pytest.raises(Overloaded) as e:
        ctl.enter(returning=True)  # before any promise's moment: a newcomer
    assert e.value.retry_after == pytest.approx(2.0 + 3.0)
    await trio.sleep_until(t0 + 3.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter(returning=False)  # says it is a first attempt: not the promised one
    # promised the second place from now: the held one is taken now for 3 s (to 6 s) and
    # goes to the newcomer refused at 1 s; the next frees 3 s later
    assert e.value.retry_after == pytest.approx(6.0)
    b = ctl.enter()  # the promised caller
    b.tag = (trio.current_time(), 3.5)
    await ctl.admit(b, 1)
    # The promise due at 6 s is next. Its caller, back at 6 s while b still runs (it
    # ends at 6.5 s), keeps its turn and is told when b ends.
    await trio.sleep_until(t0 + 6.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == pytest.approx(0.5)
    assert ctl.statistics().promised == 2
    # It never comes back: its promise lapses 2 s after its moment (8.5 s), and the
    # place, back at 6.5 s, is held for the next promise, due at 9 s.
    await trio.sleep_until(t0 + 6.5)
    b.release()
    await trio.sleep_until(t0 + 8.5 + 0.01)
    assert ctl.statistics().promises_held == 1
    with pytest.raises(Overloaded):
        ctl.enter(returning=False)
    await trio.sleep_until(t0 + 9.0)
    ctl.enter()
    stats = ctl.statistics()
    assert (stats.promised, stats.promises_kept_total, stats.promises_lapsed_total) == (1, 2, 1)


async def test_a_tokens_place_goes_to_its_token_and_polling_gains_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot, no queue, the running request ends at 3 s. A caller that speaks
    tokens is refused with a token and promised the place. Asking again early with
    the token is told the rest of its wait and makes no second promise, however often
    it asks; nobody without the token takes the place (a poller that returns without
    it is a newcomer, whatever the clock says); the token takes it at its moment. An
    unclaimed token's promise lapses TOKEN_GRACE_S after its moment."""
    ctl, t0, a = await _one_running(unknown=3.0, seconds=3.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter(token="")
    token, told = e.value.token, e.value.retry_after
    assert token
    assert told == pytest.approx(3.0)
    for k in range(1, 10):  # a poller with its token, every 0.25 s
        await trio.sleep_until(t0 + 0.25 * k)
        with pytest.raises(Overloaded) as e:
            ctl.enter(token=token, returning=True)
        assert (e.value.token, e.value.retry_after) == (token, pytest.approx(3.0 - 0.25 * k))
    assert ctl.statistics().promised == 1
    a.release()
    await trio.sleep_until(t0 + 3.0)
    with pytest.raises(Overloaded) as e:  # the clock's claim: not a token's promise
        ctl.enter(returning=True)
    assert e.value.token != token
    assert ctl.enter(token=token).admitted is False  # its place
    assert ctl.statistics().promises_kept_total == 1
    # The newcomer refused at 3 s spoke no tokens: the clock may take its place. A
    # token caller refused now is promised the place after it; it never comes back,
    # and its promise lapses TOKEN_GRACE_S (not PROMISE_GRACE_S) after its moment.
    with pytest.raises(Overloaded) as e:
        ctl.enter(token="new")
    due = trio.current_time() + e.value.retry_after
    await trio.sleep_until(due + TOKEN_GRACE_S + 0.01)
    assert ctl.statistics().promises_lapsed_total >= 1


async def test_a_known_clients_place_goes_to_it_and_polling_gains_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot, no queue, the running request ends at 3 s. Two clients without tokens,
    known by their address: "a" is refused and promised the place. "p" polls every
    0.1 s without a token: its first poll is promised the place after a's; its later
    polls are told the rest of its own wait and make no new promise; and when a's
    moment has passed, p's polls cannot take a's place. a takes it at its moment; p
    takes the next place at its own."""
    ctl, t0, running = await _one_running(unknown=3.0, seconds=3.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter(client="a")
    told_a = e.value.retry_after
    assert told_a == pytest.approx(3.0)
    await trio.sleep_until(t0 + 0.1)
    with pytest.raises(Overloaded) as e:
        ctl.enter(client="p")  # a first poll: its promise, after a's
    p_due = trio.current_time() + e.value.retry_after
    for k in range(2, 40):  # every 0.1 s, up to 3.9 s
        await trio.sleep_until(t0 + 0.1 * k)
        if k == 30:
            running.release()  # the place is back at 3 s, held for a
        with pytest.raises(Overloaded) as e:
            ctl.enter(client="p")
        assert trio.current_time() + e.value.retry_after == pytest.approx(p_due)
        assert ctl.statistics().promised == 2  # a's and p's: no more
    mine = ctl.enter(client="a")  # back at its moment (and later than it)
    assert ctl.statistics().promises_kept_total == 1
    mine.release()
    await trio.sleep_until(p_due)
    ctl.enter(client="p").release()
    assert ctl.statistics().promises_kept_total == 2


async def test_first_attempts_of_one_client_each_hold_a_promise(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Several users behind one address: each first attempt (an SDK's retry count 0) is
    a request of its own and is promised a place of its own; the client's returning
    callers take them in turn, each at or after a moment of the client's."""
    ctl = AdmissionController(max_running=1, max_pending=0, units_total=10,
                              service_time=lambda ts: [1.0] * len(ts))  # fmt: skip
    t0 = trio.current_time()
    running = ctl.enter()
    moments = []
    for _ in range(3):
        with pytest.raises(Overloaded) as e:
            ctl.enter(client="nat", returning=False)
        moments.append(trio.current_time() + e.value.retry_after)
    assert ctl.statistics().promised == 3
    assert moments == sorted(moments)
    assert moments[1] > moments[0]
    held = running
    for due in moments:
        await trio.sleep_until(max(due, held.arrival + 1.0))
        held.release()
        held = ctl.enter(client="nat", returning=True)  # its client's place, in turn
    assert ctl.statistics().promises_kept_total == 3
    assert trio.current_time() - t0 < 5.0


async def test_a_queue_held_by_units_frees_places_in_fifo_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The head of the queue needs units that only free when both running requests
    end: the estimate follows the scheduler's own rule (no overtaking)."""
    ctl = _exact(max_running=3, max_pending=1, units_total=10)
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
    ctl = _exact(max_running=1, max_pending=0, units_total=10)
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


async def test_a_newcomer_backfills_a_held_place_it_will_give_back_in_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A place held for a promise due in 9 s, where requests take 1 s: a newcomer may
    use it meanwhile (it will be done long before); half a second before the promise is
    due, it may not; the promised caller then finds its place."""
    ctl, t0, a = await _one_running(unknown=1.0, seconds=10.0)
    with pytest.raises(Overloaded) as e:
        ctl.enter()
    assert e.value.retry_after == pytest.approx(10.0)
    await trio.sleep(1.0)
    a.release()  # early: the place is held, due at 10 s
    b = ctl.enter(returning=False)  # backfills: like the others, done at 2 s
    b.tag = (trio.current_time(), 1.0)
    await ctl.admit(b, 1)
    await trio.sleep(1.0)
    b.release()
    await trio.sleep_until(t0 + 9.5)
    with pytest.raises(Overloaded):
        ctl.enter(returning=False)  # would not be done before the promise is due
    await trio.sleep_until(t0 + 10.0)
    ctl.enter()  # the promised caller
    assert ctl.statistics().promises_kept_total == 1


async def test_a_refusal_a_balancer_retries_elsewhere_holds_no_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`promise=False` (the header nginx's first attempt carries): refused, told, but
    no place is held for a client that will not come back here."""
    ctl = _exact(max_running=1, max_pending=0, units_total=10, unknown=1.0)
    a = ctl.enter()
    a.tag = (trio.current_time(), 2.0)
    await ctl.admit(a, 1)
    with pytest.raises(Overloaded) as e:
        ctl.enter(promise=False)
    assert e.value.retry_after == pytest.approx(2.0)
    assert ctl.statistics().promised == 0
    a.release()
    ctl.enter(returning=False)  # the place is free for anyone


async def test_a_wide_head_blocks_the_queue_until_its_deadline_then_the_next_goes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The head-of-line rule with n: a request for every slot (n = max concurrency)
    waits at the head for all of them, and a one-slot request behind it waits too,
    though a slot is free (no overtaking: the wide one is never starved). Its deadline
    still holds: when it passes, the wide one leaves and the next is admitted at once."""
    ctl = AdmissionController(max_running=2, max_pending=2, units_total=10)
    busy = ctl.enter()
    await ctl.admit(busy, 1)  # one of two slots, for 30 s
    admitted: list[tuple[str, float]] = []
    t0 = trio.current_time()

    async def want(name: str, slots: int, deadline: float) -> None:
        with ctl.enter() as t, trio.move_on_at(t0 + deadline):
            await ctl.admit(t, 1, slots=slots)
            admitted.append((name, trio.current_time() - t0))
            await trio.sleep_forever()

    async with trio.open_nursery() as n:
        n.start_soon(want, "wide", 2, 10.0)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(want, "small", 1, 60.0)
        await trio.sleep(9.0)
        assert admitted == []  # a slot is free, but the wide head holds the line
        await trio.sleep(1.5)
        assert admitted == [("small", 10.0)]  # the wide one's deadline passed
        busy.release()
        n.cancel_scope.cancel()


async def test_promises_are_bounded(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A place past the estimate's horizon (60 s) is told, not held, and no more than
    MAX_PROMISES are outstanding (every arrival looks at them): requests of 1 s, one
    slot, the 61st refused is past the horizon; with a cap of 5, five are held."""
    from scheduler import _admission

    ctl = _exact(max_running=1, max_pending=0, units_total=10, unknown=1.0)
    a = ctl.enter()
    a.tag = (trio.current_time(), 1.0)
    await ctl.admit(a, 1)
    told = []
    for _ in range(70):
        with pytest.raises(Overloaded) as e:
            ctl.enter(returning=False)
        told.append(e.value.retry_after)
    assert told[:3] == pytest.approx([1.0, 2.0, 3.0])
    assert told[-1] == RETRY_AFTER_MAX_S
    assert ctl.statistics().promised == sum(t < RETRY_AFTER_MAX_S for t in told) < 70
    monkeypatch.setattr(_admission, "MAX_PROMISES", 5)
    capped = _exact(max_running=1, max_pending=0, units_total=10, unknown=1.0)
    b = capped.enter()
    b.tag = (trio.current_time(), 1.0)
    await capped.admit(b, 1)
    for _ in range(10):
        with pytest.raises(Overloaded):
            capped.enter(returning=False)
    assert capped.statistics().promised == 5
