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
waiting (what overload looks like). Without `service_time` the estimate falls back to
the recent drain rate.

Promises. A refusal is a promise: the caller is told when a place will be free for
it, and that place is held for it. Promises are kept in the order they were made: a
caller refused while k - 1 promises wait for a place is told when the k-th place from
now comes back (plus a small margin, so that the place is back when it returns), and
each place that comes back is held, free, for the oldest promise. A caller that
arrives at or after a promise's moment (the scheduler cannot tell who is who; it
trusts the clock: a client that honours Retry-After arrives just after its moment)
takes a held place; a newcomer only takes a place that no promise holds, so it waits
behind every outstanding promise (refused in turn, it is promised a later place),
unless it backfills: played forward, a request like those waiting would be done with
the place before the first promise a held place waits for is due (with a wide
margin). A caller that arrives at its moment before its place is back keeps its turn
and is told again (with the wide margin). A promise lapses `grace` seconds after its
moment (a caller that gave up), and its place goes to the next. A caller that says it
is a first attempt (`returning=False`) never takes a promised place.

Tokens. Each promise has a token, given with the refusal. A caller that speaks tokens
(it sends one, or asks for one, with each attempt) is held to its promise: its place
is taken only by the retry that returns its token, a return before the moment is told
the rest of its wait and makes no new promise (a caller holds one promise, however
often it asks), and the promise lapses `token_grace` after its moment (such a caller
returns on time: one that gave up holds its place for less). Only the promises of
callers that do not speak tokens are taken by the clock, as above: a caller that
returns without a token cannot take a place promised to one that has it. And places
are held for tokens' promises first: a promise without a token cannot be told from a
poller's tenth (each of its refusals made one, and each is taken by its next poll), so
where both wait, the promises that can be proved come first.

Clients. A caller without a token may still be known by what it already is to the
caller of `enter` (`client`: an opaque key, e.g. its network address). Its promises are
its client's: the clock hands a client's due promise only to that client's callers, so
a poller cannot take a place promised to another client; and a client's caller that
does not say it is a first attempt, arriving while the client holds a promise not yet
due, is told the rest of that wait and makes no new one (a client that polls holds one
promise, however often it asks, as a token's caller does). A caller that says it is a
first attempt is a new request of the same client (several users behind one address,
each SDK call's first try): it gets a promise of its own, which the client's returning
callers take in turn. A caller with neither a token nor a client is the clock's, as
above.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType

import attrs
import trio

from scheduler._errors import Overloaded

__all__ = [
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "TOKEN_GRACE_S",
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
# A promise is told its place's estimate plus this margin (seconds) and this fraction of
# it, so that the place is back when the caller returns (the estimate errs by about an
# engine step, and by a few percent over many places); it lapses this long after its
# moment (a caller that rounds Retry-After up to whole seconds is a second late).
PROMISE_MARGIN_S = 0.25
PROMISE_MARGIN_FRACTION = 0.05
PROMISE_GRACE_S = 2.0
# A token's promise lapses sooner: its caller reads retry-after-ms, not whole seconds.
TOKEN_GRACE_S = 0.5
# The most promises outstanding at once (a flood of refusals past it is told, not held).
MAX_PROMISES = 4096


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
    promised: int = 0  # refused callers whose promise is outstanding
    promises_held: int = 0  # free places held for them
    promises_kept_total: int = 0  # callers that came back and took their place
    promises_lapsed_total: int = 0  # promises whose caller did not come back in time


@attrs.define(eq=False)
class _Promise:
    due: float  # when the caller was told to come back (trio time)
    lapses: float
    token: str  # given with the refusal
    bound: bool  # taken only with its token (its caller speaks tokens)
    client: str | None = None  # a caller without a token: its client, where known


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
    # Promises (see the module docstring): the margin told on top of an estimate, in
    # seconds and as a fraction of it, and how long after its moment a promise lapses.
    margin: float = PROMISE_MARGIN_S
    margin_fraction: float = PROMISE_MARGIN_FRACTION
    grace: float = PROMISE_GRACE_S
    token_grace: float = TOKEN_GRACE_S
    _promises: deque[_Promise] = attrs.field(factory=deque)  # in the order made
    _by_token: dict[str, _Promise] = attrs.field(factory=dict)
    _kept_total: int = 0
    _lapsed_total: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_running < 1 or self.max_pending < 0 or self.units_total < 1:
            raise ValueError("max_running >= 1, max_pending >= 0 and units_total >= 1 required")

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_pending

    def enter(
        self,
        *,
        returning: bool | None = None,
        promise: bool = True,
        token: str | None = None,
        client: str | None = None,
    ) -> Ticket:
        """Take a place now, or raise `Overloaded` at once when none is left for this
        caller (see Promises, Tokens and Clients in the module docstring). `returning`:
        whether the caller says it is retrying (None: it does not say); `promise=False`:
        a refusal holds no place (the caller will not come back here: a balancer retries
        it elsewhere); `token`: the token of the caller's promise, or "" for a caller
        that speaks tokens and holds none (None: it does not speak them); `client`: who
        a caller without a token is (None: unknown)."""
        now = trio.current_time()
        self._lapse(now)
        free = self.capacity - self._in_system
        mine = self._by_token.get(token) if token else None
        if mine is not None:
            if mine.due > now:  # early: the rest of its wait, and no second promise
                self._rejected_total += 1
                raise Overloaded(_clamp(mine.due - now), mine.token)
            return self._claim(mine, now, free)
        if token is None:
            client_early = None
            if returning is not False:
                # Which caller this is, the clock cannot tell (past its client): it takes
                # the oldest due promise whose place is back, else is told again as the
                # latest moment passed (the likeliest to be its own: a client that
                # honours Retry-After returns just after it). A known client's caller
                # looks at its client's promises only, and one back before any is due
                # is told the rest of the first's wait. One pass: a flood's arrivals
                # each look.
                ready = latest = None
                for i, p in enumerate(self._order()):
                    if p.bound or p.client != client:
                        continue
                    if p.due <= now:
                        latest = p
                        if ready is None and i < free:
                            ready = p
                    elif client is not None and client_early is None:
                        client_early = p
                if latest is not None:
                    return self._claim(ready or latest, now, free)
            if client_early is not None:  # a known client back early: no second promise
                self._rejected_total += 1
                raise Overloaded(_clamp(client_early.due - now), client_early.token)
        # The places a caller waits behind: every promise's, or, for one that speaks
        # tokens, the tokens' (they come first).
        ahead = len(self._promises) if token is None else sum(p.bound for p in self._promises)
        if free > ahead or (free > 0 and self._backfills(now, free)):
            return self._take(now)
        self._rejected_total += 1
        told = self._promise_in(ahead - free + 1)
        # A place past the estimate's horizon is no promise (the figures it would be made
        # of mean little), and promises are bounded: each costs every arrival a look.
        if promise and told < RETRY_AFTER_MAX_S and len(self._promises) < MAX_PROMISES:
            bound = token is not None
            grace = self.token_grace if bound else self.grace
            made = _Promise(now + told, now + told + grace, secrets.token_urlsafe(12), bound,
                            None if bound else client)  # fmt: skip
            self._promises.append(made)
            self._by_token[made.token] = made
            raise Overloaded(told, made.token)
        raise Overloaded(told)

    def _claim(self, claimed: _Promise, now: float, free: int) -> Ticket:
        """A due promise's caller is back: its place (the free places are held for the
        oldest promises first), or, not back yet, its turn kept and told again."""
        turn = self._order().index(claimed)
        if free > turn:
            self._promises.remove(claimed)
            del self._by_token[claimed.token]
            self._kept_total += 1
            return self._take(now)
        told = self._promise_in(turn + 1, again=True)
        grace = self.token_grace if claimed.bound else self.grace
        claimed.due, claimed.lapses = now + told, now + told + grace
        self._rejected_total += 1
        raise Overloaded(told, claimed.token)

    def _take(self, now: float) -> Ticket:
        self._in_system += 1
        ticket = Ticket(controller=self, arrival=now, seq=next(self._seq))
        self._live[ticket.seq] = ticket
        return ticket

    def _order(self) -> list[_Promise]:
        """The promises in the order free places are held for them: tokens' first (a
        place promised to a token can be taken by nobody else; one promised without can
        be taken by any caller without a token, a poller's many included), each kind in
        the order made."""
        bound = [p for p in self._promises if p.bound]
        if not bound:
            return list(self._promises)
        return bound + [p for p in self._promises if not p.bound]

    def _lapse(self, now: float) -> None:
        kept = deque(p for p in self._promises if p.lapses >= now)
        if len(kept) < len(self._promises):
            self._lapsed_total += len(self._promises) - len(kept)
            self._promises = kept
            self._by_token = {p.token: p for p in kept}

    def _backfills(self, now: float, free: int) -> bool:
        """Whether a newcomer may take a free place held for a promise (backfilling):
        played forward, a request like those waiting that joined now would be done, with
        a promise's margin, before the first of the held places' promises is due. A
        promise told late so does not leave places idle; one told right is not delayed
        (unless the newcomer is larger than those before it)."""
        if self.service_time is None:
            return False
        first_due = min(p.due for p in self._order()[:free]) - now
        _, done = self._forward(0, extra=None, like_joiner=True)
        if done is None:
            return False
        return self._with_margin(done, wide=True) <= first_due

    def _with_margin(self, seconds: float, *, wide: bool = False) -> float:
        """`seconds` with a promise's margin; `wide`: twice the margin's seconds and four
        times its fraction (a caller told again, whose place was late once already, and
        a backfill, which must not make a promise late)."""
        if wide:
            return seconds * (1 + 4 * self.margin_fraction) + 2 * self.margin
        return seconds * (1 + self.margin_fraction) + self.margin

    def _promise_in(self, k: int, *, again: bool = False) -> float:
        """What a caller promised the k-th place from now is told (`again`: a caller
        whose place was not back when it returned)."""
        return _clamp(self._with_margin(self.place_free_in(k), wide=again))

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

    def _forward(
        self, places: int, *, extra: int | None, like_joiner: bool = False
    ) -> tuple[list[float], float | None]:
        """Play the rules forward from now: the times (from now) at which the next
        `places` tickets are released, and, with `extra` units, when a ticket asking
        for them and joining the queue now would be admitted (with `like_joiner`, when
        a request like those waiting that joined now would be done). Tickets still
        being prepared join the queue in arrival order, with no units; each released
        place is taken again at once by a request like those waiting (it joins the
        queue's tail). Stops at RETRY_AFTER_MAX_S."""
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
        # A free place held for a promise is taken at the promise's moment by a request
        # like those waiting: it joins the queue then.
        now_t = trio.current_time()
        held = self._order()[: max(0, self.capacity - self._in_system)]
        arrivals = deque(sorted(max(0.0, p.due - now_t) for p in held))
        if extra is not None:
            waiting.append((extra, 1, 0.0, True))
        elif like_joiner:
            if like is None:
                return [], None
            waiting.append((like[0], like[1], like[2], True))
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
                    joined_at = now + service  # admitted now (or, like, done then)
                    continue
                heapq.heappush(ending, (now + service, units, slots))
                running += slots
                units_used += units
            joining = extra is not None or like_joiner
            done = len(released) >= places and (not joining or joined_at is not None)
            if done or not (ending or arrivals) or now > RETRY_AFTER_MAX_S:
                return released, joined_at
            if arrivals and (not ending or arrivals[0] <= ending[0][0]):
                now = arrivals.popleft()
                waiting.append(like or (0, 1, 0.0, False))
                continue
            now, units, slots = heapq.heappop(ending)
            running -= slots
            units_used -= units
            released.append(now)
            if like is not None:
                waiting.append(like)

    def place_free_in(self, k: int = 1) -> float:
        """Seconds until the k-th place from now is free (clamped to the documented
        range)."""
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
        self._lapse(trio.current_time())
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
            promised=len(self._promises),
            promises_held=min(len(self._promises), self.capacity - self._in_system),
            promises_kept_total=self._kept_total,
            promises_lapsed_total=self._lapsed_total,
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
