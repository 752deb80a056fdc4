"""Admission control: bounded lifetime capacity, FIFO waiting for a slot and for units.

A request takes a `Ticket` when it arrives (`enter`, which never waits: it refuses
with `Overloaded` when `max_running + max_pending` tickets are already out). The
ticket counts for the request's whole lifetime: preparation, waiting, running, and
finished-but-not-yet-sent. `admit` then waits, in arrival order, until a running
slot and the ticket's `units` (KV pages, to the caller) are both free; the head of
the queue blocks those behind it (no overtaking, so a large request cannot starve).
Deadlines are the caller's: wrap `admit` in `trio.move_on_at`. A waiter that is
cancelled (client gone, deadline) leaves the queue at once and frees its place.

Retry estimates. The caller may pass `service_time(tickets)`, which gives, per ticket:
for an admitted ticket
the seconds until it will be released, for any other the seconds it will hold a
slot once admitted (the scheduler knows nothing of what a request is; the caller
does, and keeps what it needs in `ticket.tag`). From those the scheduler plays its
own rules forward (slots, units, FIFO) to find when places free up; past the tickets
out now, each place that frees is taken again at once by a request like those
waiting (what overload looks like). Places are promised to refused callers in the
order they were refused: the k-th place from now goes to the caller refused when
k - 1 promised places had not come back yet, and that caller is told when it frees.
Callers refused together are so spread over the places as they come back, instead
of all retrying at once into one; a promise is kept or lapses when a place really
comes back, never by the clock, so an estimate that is off does not feed on itself.
Without `service_time` the estimate falls back to the recent drain rate.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType

import attrs
import trio

from scheduler._errors import Overloaded

__all__ = [
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "AdmissionController",
    "SchedulerStatistics",
    "ServiceTime",
    "Ticket",
]

# How many recent completions the drain-rate estimate looks at.
_DRAIN_WINDOW = 32
# Every estimate is clamped to this range (seconds): never "now" (a client would spin),
# never further than a minute (past that, the figures it is made of mean little).
RETRY_AFTER_MIN_S = 0.05
RETRY_AFTER_MAX_S = 60.0


@attrs.frozen
class SchedulerStatistics:
    max_running: int
    max_pending: int
    in_system: int  # tickets out: preparing + waiting + running + finishing
    waiting: int  # in the FIFO queue
    running: int  # running slots held (a ticket holds one per sequence it decodes)
    units_total: int
    units_used: int
    units_free: int
    admitted_total: int
    rejected_total: int
    drain_rate: float  # completions per second recently observed; 0.0 when unknown


@attrs.define(eq=False)
class Ticket:
    """One request's place. Use as a context manager: leaving it releases everything."""

    _controller: AdmissionController = attrs.field(alias="controller")
    arrival: float
    seq: int = 0  # arrival order
    units: int = 0
    slots: int = 1  # running slots it holds once admitted (sequences decoded together)
    admitted: bool = False
    queued: bool = False
    released: bool = False
    tag: object = None  # the caller's own data (what `service_time` reads)
    _event: trio.Event = attrs.field(factory=trio.Event, alias="event")

    def release(self) -> None:
        self._controller._release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# The caller's service times for the tickets given, in order (see the module docstring).
ServiceTime = Callable[[Sequence[Ticket]], Sequence[float]]


@attrs.define(eq=False)
class AdmissionController:
    max_running: int
    max_pending: int
    units_total: int
    service_time: ServiceTime | None = None
    _in_system: int = 0
    _running: int = 0
    _units_used: int = 0
    _queue: deque[Ticket] = attrs.field(factory=deque)
    _live: dict[int, Ticket] = attrs.field(factory=dict)  # by seq: arrival order
    _seq: itertools.count[int] = attrs.field(factory=itertools.count)
    _completions: deque[float] = attrs.field(factory=lambda: deque(maxlen=_DRAIN_WINDOW))
    _admitted_total: int = 0
    _rejected_total: int = 0
    _places_back: int = 0  # places that came back (tickets released), ever
    _places_promised: int = 0  # the index of the last place promised to a refused caller

    def __attrs_post_init__(self) -> None:
        if self.max_running < 1 or self.max_pending < 0 or self.units_total < 1:
            raise ValueError("max_running >= 1, max_pending >= 0 and units_total >= 1 required")

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_pending

    def enter(self) -> Ticket:
        """Take a place now, or raise `Overloaded` at once when none is left."""
        if self._in_system >= self.capacity:
            self._rejected_total += 1
            self._places_promised = max(self._places_promised, self._places_back) + 1
            raise Overloaded(self.place_free_in(self._places_promised - self._places_back))
        self._in_system += 1
        ticket = Ticket(controller=self, arrival=trio.current_time(), seq=next(self._seq))
        self._live[ticket.seq] = ticket
        return ticket

    def fits(self, units: int, slots: int = 1) -> bool:
        """Whether `units` and `slots` could ever be granted (the pool and the running
        slots are big enough)."""
        return units <= self.units_total and 1 <= slots <= self.max_running

    async def admit(self, ticket: Ticket, units: int, slots: int = 1) -> None:
        """Wait in FIFO order for `slots` running slots (one per sequence the request
        decodes) and `units`; cancellable at any point."""
        if ticket.released or ticket.admitted:
            raise RuntimeError("ticket already admitted or released")
        if not self.fits(units, slots):
            raise ValueError(
                f"{units} units and {slots} slots can never be granted (pool of "
                f"{self.units_total}, {self.max_running} slots)"
            )
        ticket.units = units
        ticket.slots = slots
        ticket.queued = True
        self._queue.append(ticket)
        self._grant()
        try:
            await ticket._event.wait()
        finally:
            if not ticket.admitted:
                ticket.queued = False
                self._queue.remove(ticket)
                self._grant()  # the head may have changed

    def _grant(self) -> None:
        while self._queue:
            head = self._queue[0]
            if self._running + head.slots > self.max_running:
                return
            if self._units_used + head.units > self.units_total:
                return
            self._queue.popleft()
            head.queued = False
            self._running += head.slots
            self._units_used += head.units
            head.admitted = True
            self._admitted_total += 1
            head._event.set()

    def _release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self._in_system -= 1
        self._live.pop(ticket.seq, None)
        self._places_back += 1
        if ticket.admitted:
            self._running -= ticket.slots
            self._units_used -= ticket.units
            self._completions.append(trio.current_time())
            self._grant()

    # ---- estimates --------------------------------------------------------------------

    def drain_rate(self) -> float:
        """Completions per second over the recent window (0.0 until two are seen)."""
        if len(self._completions) < 2:
            return 0.0
        span = self._completions[-1] - self._completions[0]
        if span <= 0:
            return 0.0
        return (len(self._completions) - 1) / span

    def _forward(self, places: int, *, extra: int | None) -> tuple[list[float], float | None]:
        """Play the rules forward from now: the times (from now) at which the next
        `places` tickets are released, and, with `extra` units, when a ticket asking
        for them and joining the queue now would be admitted. Tickets still being
        prepared join the queue in arrival order, with no units; each released place
        is taken again at once by a request like those waiting (it joins the queue's
        tail). Stops at RETRY_AFTER_MAX_S."""
        assert self.service_time is not None
        running_now = [t for t in self._live.values() if t.admitted]  # arrival order
        preparing = [t for t in self._live.values() if not t.admitted and not t.queued]
        pending = [*self._queue, *preparing]
        # One call for every ticket (and a probe of unknown size, for the fallback).
        probe = Ticket(controller=self, arrival=trio.current_time(), seq=-1)
        seconds = [max(0.0, s) for s in self.service_time([*running_now, *pending, probe])]
        ending = [(s, t.units, t.slots) for t, s in zip(running_now, seconds, strict=False)]
        heapq.heapify(ending)  # (seconds from now, units, slots)
        # (units, slots, service s, the joiner)
        waiting: deque[tuple[int, int, float, bool]] = deque()
        sized: list[tuple[int, int, float, bool]] = []  # those whose size the caller knows
        for t, s in zip(pending, seconds[len(running_now) :], strict=False):
            entry = (t.units, t.slots, s, False)
            waiting.append(entry)
            if t.units or t.tag is not None:
                sized.append(entry)
        # A request like those waiting (else, one the caller knows nothing of) takes
        # each place that frees.
        like = _typical(sized) or ((0, 1, seconds[-1], False) if seconds[-1] > 0 else None)
        if extra is not None:
            waiting.append((extra, 1, 0.0, True))
        running, units_used = sum(n for _, _, n in ending), sum(u for _, u, _ in ending)
        released: list[float] = []
        joined_at: float | None = None
        now = 0.0
        while True:
            while waiting:
                units, slots, service, joiner = waiting[0]
                if running + slots > self.max_running or units_used + units > self.units_total:
                    break
                waiting.popleft()
                if joiner:
                    joined_at = now
                    continue
                heapq.heappush(ending, (now + service, units, slots))
                running += slots
                units_used += units
            done = len(released) >= places and (extra is None or joined_at is not None)
            if done or not ending or now > RETRY_AFTER_MAX_S:
                return released, joined_at
            now, units, slots = heapq.heappop(ending)
            running -= slots
            units_used -= units
            released.append(now)
            if like is not None:
                waiting.append(like)

    def place_free_in(self, k: int = 1) -> float:
        """Seconds until the k-th place from now is free (clamped to the documented
        range): what a caller refused while k - 1 promised places have not come back
        is told."""
        if self.service_time is None:
            rate = self.drain_rate()
            return _clamp(k / rate if rate > 0 else 1.0)
        released, _ = self._forward(k, extra=None)
        if not released:
            return RETRY_AFTER_MIN_S  # nothing holds a place: there is room now
        if len(released) < k:  # beyond the horizon, or nothing to refill with
            return _clamp(released[-1])
        return _clamp(released[k - 1])

    def admitted_in(self, units: int = 0) -> float:
        """Seconds until a request for `units` that joined the queue now would be
        admitted (what a request that timed out in the queue is told)."""
        if self.service_time is None:
            rate = self.drain_rate()
            return _clamp((len(self._queue) + 1) / rate if rate > 0 else 1.0)
        _, joined = self._forward(0, extra=units)
        return _clamp(joined if joined is not None else RETRY_AFTER_MAX_S)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            max_running=self.max_running,
            max_pending=self.max_pending,
            in_system=self._in_system,
            waiting=len(self._queue),
            running=self._running,
            units_total=self.units_total,
            units_used=self._units_used,
            units_free=self.units_total - self._units_used,
            admitted_total=self._admitted_total,
            rejected_total=self._rejected_total,
            drain_rate=self.drain_rate(),
        )


def _clamp(seconds: float) -> float:
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, seconds))


def _typical(
    sized: list[tuple[int, int, float, bool]],
) -> tuple[int, int, float, bool] | None:
    """A request like those waiting: their mean units, slots and service time."""
    if not sized:
        return None
    units = round(sum(u for u, _, _, _ in sized) / len(sized))
    slots = max(1, round(sum(n for _, n, _, _ in sized) / len(sized)))
    seconds = sum(s for _, _, s, _ in sized) / len(sized)
    return (units, slots, seconds, False) if seconds > 0 else None
