"""How long a request will hold its place: the LLM knowledge behind Retry-After.

The scheduler plays its own rules forward (slots, KV pages, FIFO) to tell a refused
client when a place will be free for it; what it asks of the server is one number
per ticket, `ServiceTimes(tickets)`: for a running request the seconds until it ends
(its remaining output budget at the engine's recent pace per token, plus its prefill if
it has not started), for any other the seconds it will run once admitted; one still
being read or prepared (its size unknown yet) is taken to be like the recent ones
(a moving average of their prompts and budgets). The budget is an upper bound (a
request may stop early at end-of-sequence or a stop string), so estimates err on
the late side. See docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from ninfer.engine import EngineStatistics
from scheduler import Ticket

__all__ = ["FALLBACK_PREFILL_S_PER_TOKEN", "FALLBACK_STEP_S", "Progress", "ServiceTimes"]

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
    """`service_time(tickets)` for the scheduler, from the engine's measured pace."""

    statistics: Callable[[], EngineStatistics | None]
    # What a request of unknown size is assumed to ask until requests have been seen.
    default_max_tokens: int
    _budget: float = 0.0  # recent requests' output budgets and prompts, moving averages
    _prompt: float = 0.0

    def track(self, ticket: Ticket, prompt_tokens: int, max_new_tokens: int) -> Progress:
        """Size a prepared request's ticket (its tag), and learn what requests are like."""
        first = self._budget == 0.0
        self._budget = max_new_tokens if first else 0.9 * self._budget + 0.1 * max_new_tokens
        self._prompt = prompt_tokens if first else 0.9 * self._prompt + 0.1 * prompt_tokens
        ticket.tag = progress = Progress(prompt_tokens, max_new_tokens)
        return progress

    def __call__(self, tickets: Sequence[Ticket]) -> list[float]:
        """Seconds each ticket will still hold its place (one read of the engine's pace
        for them all: a refusal's forward play asks for every ticket at once)."""
        st = self.statistics()
        step = st.decode_step_seconds if st and st.decode_step_seconds > 0 else FALLBACK_STEP_S
        # A token's time: a step's, over the tokens a step gives a row (speculation
        # gives more than one).
        step /= max(1.0, st.decode_tokens_per_row) if st else 1.0
        per_token = (
            st.prefill_seconds_per_token
            if st and st.prefill_seconds_per_token > 0
            else FALLBACK_PREFILL_S_PER_TOKEN
        )
        return [self._one(t, step, per_token) for t in tickets]

    def _one(self, ticket: Ticket, step: float, per_token: float) -> float:
        p = ticket.tag
        if not isinstance(p, Progress):  # still reading or preparing: like recent ones
            if self._budget == 0.0:
                return self.default_max_tokens * step
            return self._prompt * per_token + self._budget * step
        prefill = p.prompt_tokens * per_token if p.generated == 0 else 0.0
        return prefill + max(0, p.max_new_tokens - p.generated) * step
