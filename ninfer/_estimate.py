"""How long a request will hold its place: the LLM knowledge behind Retry-After.

The scheduler plays its own rules forward (slots, KV pages, FIFO) to tell a refused
client when a place will be free for it; what it asks of the server is one number
per ticket, `ServiceTimes(ticket)`: for a running request the seconds until it ends
(its remaining output budget at the engine's recent step pace, plus its prefill if
it has not started), for any other the seconds it will run once admitted; one still
being read or prepared (its size unknown yet) is taken to be like the recent ones
(a moving average of their prompts and budgets). The budget is an upper bound (a
request may stop early at end-of-sequence or a stop string), so estimates err on
the late side. See docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from ninfer.engine import EngineStatistics
from scheduler import Ticket

__all__ = ["FALLBACK_PREFILL_S_PER_TOKEN", "FALLBACK_STEP_S", "Progress", "ServiceTimes"]

# The engine's pace is read at most this often (well under one decode step).
PACE_READ_S = 0.005
# Until the engine has measured its pace (a fresh server), this is assumed.
FALLBACK_STEP_S = 0.05
FALLBACK_PREFILL_S_PER_TOKEN = 0.002


@attrs.define
class Progress:
    """A prepared request's size and how far it has come: its ticket's tag."""

    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0


@attrs.define
class ServiceTimes:
    """`service_time(ticket)` for the scheduler, from the engine's measured pace."""

    statistics: Callable[[], EngineStatistics | None]
    # What a request of unknown size is assumed to ask until requests have been seen.
    default_max_tokens: int
    _budget: float = 0.0  # recent requests' output budgets and prompts, moving averages
    _prompt: float = 0.0
    # The engine's pace, read at most once per PACE_READ_S of Trio time: one refusal's
    # forward play asks for every ticket at once, and the pace moves once per step.
    _pace: tuple[float, float] = (FALLBACK_STEP_S, FALLBACK_PREFILL_S_PER_TOKEN)
    _pace_read_at: float = float("-inf")

    def track(self, ticket: Ticket, prompt_tokens: int, max_new_tokens: int) -> Progress:
        """Size a prepared request's ticket (its tag), and learn what requests are like."""
        first = self._budget == 0.0
        self._budget = max_new_tokens if first else 0.9 * self._budget + 0.1 * max_new_tokens
        self._prompt = prompt_tokens if first else 0.9 * self._prompt + 0.1 * prompt_tokens
        ticket.tag = progress = Progress(prompt_tokens, max_new_tokens)
        return progress

    def _read_pace(self) -> tuple[float, float]:
        """(seconds a decode step, prefill seconds a prompt token), measured or assumed."""
        now = trio.current_time()
        if now - self._pace_read_at >= PACE_READ_S:
            st = self.statistics()
            step = st.decode_step_seconds if st and st.decode_step_seconds > 0 else 0.0
            per_token = st.prefill_seconds_per_token if st else 0.0
            self._pace = (step or FALLBACK_STEP_S, per_token or FALLBACK_PREFILL_S_PER_TOKEN)
            self._pace_read_at = now
        return self._pace

    def __call__(self, ticket: Ticket) -> float:
        step, per_token = self._read_pace()
        p = ticket.tag
        if not isinstance(p, Progress):  # still reading or preparing: like recent ones
            if self._budget == 0.0:
                return self.default_max_tokens * step
            return self._prompt * per_token + self._budget * step
        prefill = p.prompt_tokens * per_token if p.generated == 0 else 0.0
        return prefill + max(0, p.max_new_tokens - p.generated) * step
