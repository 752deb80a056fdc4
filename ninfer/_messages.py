"""The engine's messages: what goes in (a generation request) and what comes out (events)."""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from ninfer._sampling import SamplingParams

__all__ = [
    "EngineTimings",
    "Event",
    "EventSink",
    "Finish",
    "FinishReason",
    "GenerationRequest",
    "RequestHandle",
    "TokenDelta",
    "Usage",
]

# eos: an end-of-sequence token; stop: a stop string; length: the output budget;
# context: the end of the context window; cancelled: the caller cancelled;
# error: serving this request failed (the message says why, the log has detail).
FinishReason = Literal["eos", "stop", "length", "context", "cancelled", "error"]


@attrs.frozen
class GenerationRequest:
    """One protocol-neutral request for the engine."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@attrs.frozen
class RequestHandle:
    """What `Engine.submit` returns; events carry it and `Engine.cancel` takes it."""

    id: int
    request_id: str


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class EngineTimings:
    """Seconds spent by the engine: waiting in its queue, prefilling, decoding."""

    wait_s: float
    prefill_s: float
    decode_s: float


@attrs.frozen
class TokenDelta:
    """New tokens of one request from one engine step, and the text they complete."""

    token_ids: tuple[int, ...]
    text: str


@attrs.frozen
class Finish:
    """The last event of a request: exactly one per request."""

    reason: FinishReason
    usage: Usage
    timings: EngineTimings
    seed: int | None
    stop_string: str | None = None
    error: str | None = None


Event = TokenDelta | Finish


class EventSink(Protocol):
    """Where the engine thread publishes: once per step, never once per token."""

    def deliver(self, events: list[tuple[RequestHandle, Event]]) -> None: ...
