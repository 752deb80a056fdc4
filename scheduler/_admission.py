"""Admission control: bounded lifetime capacity, FIFO waiting for a slot and for units.

A request takes a `Ticket` when it arrives (`enter`, which never waits: it refuses
with `Overloaded` when `max_running + max_pending` tickets are already out). The
ticket counts for the request's whole lifetime: preparation, waiting, running, and
finished-but-not-yet-sent. `admit` then waits, in arrival order, until a running
slot and the ticket's `units` (KV pages, to the caller) are both free; the head of
the queue blocks those behind it (no overtaking, so a large request cannot starve).
Deadlines are the caller's: wrap `admit` in `trio.move_on_at`. A waiter that is
cancelled (client gone, deadline) leaves the queue at once and frees its place.
"""

from __future__ import annotations

import math
from collections import deque
from types import TracebackType

import attrs
import trio

from scheduler._errors import Overloaded

__all__ = ["AdmissionController", "SchedulerStatistics", "Ticket"]

# How many recent completions the drain-rate estimate looks at.
_DRAIN_WINDOW = 32
_RETRY_AFTER_MAX_S = 60


@attrs.frozen
class SchedulerStatistics:
    max_running: int
    max_pending: int
    in_system: int  # tickets out: preparing + waiting + running + finishing
    waiting: int  # in the FIFO queue
    running: int  # holding a running slot
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
    units: int = 0
    admitted: bool = False
    released: bool = False
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


@attrs.define(eq=False)
class AdmissionController:
    max_running: int
    max_pending: int
    units_total: int
    _in_system: int = 0
    _running: int = 0
    _units_used: int = 0
    _queue: deque[Ticket] = attrs.field(factory=deque)
    _completions: deque[float] = attrs.field(factory=lambda: deque(maxlen=_DRAIN_WINDOW))
    _admitted_total: int = 0
    _rejected_total: int = 0

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
            raise Overloaded(self.retry_after())
        self._in_system += 1
        return Ticket(controller=self, arrival=trio.current_time())

    def fits(self, units: int) -> bool:
        """Whether `units` could ever be granted (the whole pool is big enough)."""
        return units <= self.units_total

    async def admit(self, ticket: Ticket, units: int) -> None:
        """Wait in FIFO order for a running slot and `units`; cancellable at any point."""
        if ticket.released or ticket.admitted:
            raise RuntimeError("ticket already admitted or released")
        if not self.fits(units):
            raise ValueError(f"{units} units can never be granted (pool of {self.units_total})")
        ticket.units = units
        self._queue.append(ticket)
        self._grant()
        try:
            await ticket._event.wait()
        finally:
            if not ticket.admitted:
                self._queue.remove(ticket)
                self._grant()  # the head may have changed

    def _grant(self) -> None:
        while self._queue:
            head = self._queue[0]
            if self._running >= self.max_running:
                return
            if self._units_used + head.units > self.units_total:
                return
            self._queue.popleft()
            self._running += 1
            self._units_used += head.units
            head.admitted = True
            self._admitted_total += 1
            head._event.set()

    def _release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self._in_system -= 1
        if ticket.admitted:
            self._running -= 1
            self._units_used -= ticket.units
            self._completions.append(trio.current_time())
            self._grant()

    def drain_rate(self) -> float:
        """Completions per second over the recent window (0.0 until two are seen)."""
        if len(self._completions) < 2:
            return 0.0
        span = self._completions[-1] - self._completions[0]
        if span <= 0:
            return 0.0
        return (len(self._completions) - 1) / span

    def retry_after(self) -> int:
        """Whole seconds until a place is likely free, from the observed drain rate (>= 1)."""
        rate = self.drain_rate()
        if rate <= 0:
            return 1
        ahead = len(self._queue) + 1
        return max(1, min(_RETRY_AFTER_MAX_S, math.ceil(ahead / rate)))

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
