"""llama-server's `timings` and `prompt_progress`, from the engine's own clocks: what
its web UI shows as tokens a second, prompt processing and the context gauge. The same
numbers on /completion and on the OpenAI routes (docs/api.md, "Timings and progress")."""

from __future__ import annotations

import attrs

from ninfer.engine import PromptProgress, TokenDelta
from ninfer.frontends._base import Outcome
from protocols import LlamaTimings, PromptProgressBody

__all__ = ["Clock", "final_timings", "progress_body"]


def _timings(cached: int, computed: int, prefill_s: float, predicted: int, decode_s: float
             ) -> LlamaTimings:  # fmt: skip
    prompt_ms, predicted_ms = prefill_s * 1000.0, decode_s * 1000.0
    return LlamaTimings(
        cache_n=cached,
        prompt_n=computed,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / computed if computed else 0.0,
        prompt_per_second=computed * 1000.0 / prompt_ms if prompt_ms > 0 else 0.0,
        predicted_n=predicted,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / predicted if predicted else 0.0,
        predicted_per_second=predicted * 1000.0 / predicted_ms if predicted_ms > 0 else 0.0,
    )


def final_timings(outcome: Outcome) -> LlamaTimings:
    """An answer's timings: its prompt tokens served from the cache and computed, the
    engine's prefill seconds, its output tokens and the engine's decode seconds (of the
    choice that took longest, where there are several)."""
    u = outcome.usage
    return _timings(
        u.cached_tokens,
        u.prompt_tokens - u.cached_tokens,
        outcome.timing["prefill"],
        u.completion_tokens,
        outcome.timing["decode"],
    )


def progress_body(p: PromptProgress) -> PromptProgressBody:
    return PromptProgressBody(
        total=p.total, cache=p.cached, processed=p.processed, time_ms=round(p.elapsed_s * 1000)
    )


@attrs.define
class Clock:
    """One streamed answer's running timings, choice by choice (`per_token`: the
    request's `timings_per_token`; else `step` answers None and only the last chunk
    carries the totals)."""

    prompt_tokens: tuple[int, ...]  # each choice's prompt length
    per_token: bool = False
    cached: dict[int, int] = attrs.field(factory=dict)
    generated: dict[int, int] = attrs.field(factory=dict)

    def step(self, index: int, delta: TokenDelta) -> LlamaTimings | None:
        """The choice's timings after `delta`, when they are sent with every token."""
        if delta.cached_tokens is not None:
            self.cached[index] = delta.cached_tokens
        n = self.generated[index] = self.generated.get(index, 0) + len(delta.token_ids)
        if not self.per_token:
            return None
        cached = self.cached.get(index, 0)
        computed = self.prompt_tokens[index] - cached
        return _timings(cached, computed, delta.prefill_s, n, delta.decode_s)
