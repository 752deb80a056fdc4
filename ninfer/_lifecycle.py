"""A request's life as an explicit state machine (sans-IO, like h11's connection states).

    ROUTE ──routed──▶ BODY ──body_read──▶ PREPARE ──prepared──▶ QUEUED ──admitted──▶ PREFILL
                                                                                      │
          RESPOND ◀──settled── DECODE ◀──first_token──────────────────────────────────┘
             │                   (PREFILL ──settled──▶ RESPOND too)
             └──sent / gone / stalled──▶ DONE

    refused:  ROUTE, BODY, PREPARE, QUEUED      ──▶ REJECTED   request_rejected
    gone:     BODY, PREPARE, QUEUED, PREFILL, DECODE ──▶ CANCELLED  request_cancelled
    stalled:  PREFILL, DECODE                   ──▶ CANCELLED  request_cancelled (write_stalled)
    failed:   any state before RESPOND          ──▶ FAILED     request_error

The outcome of a request is decided by exactly one transition, and that transition
writes its one terminal record: `settled` writes request_done (before the answer is
written, so a client that closes as soon as it has read the last byte is still a
completed request), `refused` request_rejected, `gone` and `stalled` before RESPOND
request_cancelled, `failed` request_error. Terminal states have no way out, and
RESPOND's ways out write nothing, so a second terminal record cannot happen: an
event the table does not list raises `LifecycleError` instead. `prepared` writes
request_start. Times are passed in (Trio's clock in the server, any number in tests).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ninfer.engine import EngineTimings, Finish

__all__ = ["TABLE", "Lifecycle", "LifecycleError", "Stage", "Trigger"]


class Stage(enum.Enum):
    ROUTE = "route"  # matched, authorized, checked for readiness and content type
    BODY = "body"  # holding a place; reading the body under its limits
    PREPARE = "prepare"  # parsing, validating, rendering, tokenizing, budgeting
    QUEUED = "queued"  # waiting in FIFO order for a slot and KV pages
    PREFILL = "prefill"  # admitted; the engine computes the prompt
    DECODE = "decode"  # tokens are coming
    RESPOND = "respond"  # the outcome is settled; the answer is being written
    DONE = "done"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Trigger(enum.Enum):
    ROUTED = "routed"
    BODY_READ = "body_read"
    PREPARED = "prepared"
    ADMITTED = "admitted"
    FIRST_TOKEN = "first_token"
    SETTLED = "settled"
    SENT = "sent"
    REFUSED = "refused"
    GONE = "gone"
    STALLED = "stalled"
    FAILED = "failed"


TERMINAL = frozenset({Stage.DONE, Stage.REJECTED, Stage.CANCELLED, Stage.FAILED})
_BEFORE_RESPOND = (
    Stage.ROUTE,
    Stage.BODY,
    Stage.PREPARE,
    Stage.QUEUED,
    Stage.PREFILL,
    Stage.DECODE,
)

# (stage, trigger) -> (next stage, the record the transition writes, if any)
TABLE: Mapping[tuple[Stage, Trigger], tuple[Stage, str | None]] = {
    (Stage.ROUTE, Trigger.ROUTED): (Stage.BODY, None),
    (Stage.BODY, Trigger.BODY_READ): (Stage.PREPARE, None),
    (Stage.PREPARE, Trigger.PREPARED): (Stage.QUEUED, "request_start"),
    (Stage.QUEUED, Trigger.ADMITTED): (Stage.PREFILL, None),
    (Stage.PREFILL, Trigger.FIRST_TOKEN): (Stage.DECODE, None),
    (Stage.PREFILL, Trigger.SETTLED): (Stage.RESPOND, "request_done"),
    (Stage.DECODE, Trigger.SETTLED): (Stage.RESPOND, "request_done"),
    (Stage.RESPOND, Trigger.SENT): (Stage.DONE, None),
    (Stage.RESPOND, Trigger.GONE): (Stage.DONE, None),
    (Stage.RESPOND, Trigger.STALLED): (Stage.DONE, None),
    **{
        (s, Trigger.REFUSED): (Stage.REJECTED, "request_rejected")
        for s in (Stage.ROUTE, Stage.BODY, Stage.PREPARE, Stage.QUEUED)
    },
    **{
        (s, Trigger.GONE): (Stage.CANCELLED, "request_cancelled")
        for s in (Stage.BODY, Stage.PREPARE, Stage.QUEUED, Stage.PREFILL, Stage.DECODE)
    },
    **{
        (s, Trigger.STALLED): (Stage.CANCELLED, "request_cancelled")
        for s in (Stage.PREFILL, Stage.DECODE)
    },
    **{(s, Trigger.FAILED): (Stage.FAILED, "request_error") for s in _BEFORE_RESPOND},
}

Emit = Callable[..., None]  # emit(event, request_id, **fields): RequestLog.emit


class LifecycleError(RuntimeError):
    """An event the transition table does not allow in the current stage: a bug."""


@attrs.define(eq=False)  # one per request: identity, and hashable
class Lifecycle:
    """One request's stage, its stage times, and its records."""

    request_id: str
    endpoint: str
    arrival: float
    emit: Emit
    stage: Stage = Stage.ROUTE
    prepared_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    tokens: tuple[int, int] | None = None  # (prompt, completion), once settled
    # Where a request the client (or the shutdown) ended was: request_cancelled's stage.
    left_at: str | None = None
    # request_start's `kind` (an embedding request's "embedding"), repeated on the
    # terminal record so a reader can tell the request's kind from that record alone.
    kind: str | None = None

    @property
    def decided(self) -> bool:
        """Whether the outcome is settled (its terminal record written)."""
        return self.stage is Stage.RESPOND or self.stage in TERMINAL

    def allows(self, trigger: Trigger) -> bool:
        return (self.stage, trigger) in TABLE

    def _go(self, trigger: Trigger, **fields: Any) -> None:
        try:
            nxt, record = TABLE[(self.stage, trigger)]
        except KeyError:
            raise LifecycleError(
                f"{trigger.value} is not allowed in stage {self.stage.value}"
            ) from None
        stage, self.stage = self.stage, nxt
        if record is not None:
            if record in ("request_rejected", "request_cancelled", "request_error"):
                fields.setdefault("stage" if record != "request_rejected" else "phase", stage.value)
            if record == "request_cancelled":
                self.left_at = fields["stage"]
            if self.kind is not None and record != "request_start":
                fields["kind"] = self.kind
            self.emit(record, self.request_id, endpoint=self.endpoint, **fields)

    # ---- the way through -------------------------------------------------------------

    def routed(self) -> None:
        self._go(Trigger.ROUTED)

    def body_read(self) -> None:
        self._go(Trigger.BODY_READ)

    def prepared(self, now: float, **start_fields: Any) -> None:
        self.prepared_at = now
        self.kind = start_fields.get("kind")
        self._go(Trigger.PREPARED, **start_fields)

    def admitted(self, now: float) -> None:
        self.admitted_at = now
        self._go(Trigger.ADMITTED)

    def first_token(self, now: float) -> None:
        self.first_token_at = now
        self._go(Trigger.FIRST_TOKEN)

    def timing(self, engine: EngineTimings, now: float) -> dict[str, float]:
        """Seconds per stage, as the native answer and request_done report them."""
        prepared = self.prepared_at if self.prepared_at is not None else self.arrival
        admitted = self.admitted_at if self.admitted_at is not None else prepared
        first = self.first_token_at if self.first_token_at is not None else now
        return {
            "prepare": prepared - self.arrival,
            "queue": (admitted - prepared) + engine.wait_s,
            "ttft": first - self.arrival,
            "prefill": engine.prefill_s,
            "decode": engine.decode_s,
            "total": now - self.arrival,
        }

    def settled(
        self,
        finish: Finish,
        timing: Mapping[str, float],
        *,
        stream: bool,
        session: Mapping[str, Any] | None = None,
        inputs: int = 1,
    ) -> None:
        # A budget cut short by a full KV pool is told to the client as its length; the
        # record says so in a field of its own (the finish reasons of schema v1 stay).
        extra: dict[str, Any] = {"cut_by": "kv_pool"} if finish.reason == "capacity" else {}
        if session is not None:  # a resumable stream: whether its client left, resumes
            extra["stream_session"] = dict(session)
        if finish.speculative is not None:  # the server speculates (--spec)
            extra["speculative"] = attrs.asdict(finish.speculative)
        if finish.reason == "embedded":  # an embedding request's (its kind: _go's)
            extra["inputs"] = inputs
        self.tokens = (finish.usage.prompt_tokens, finish.usage.completion_tokens)
        self._go(
            Trigger.SETTLED,
            **extra,
            finish_reason="length" if finish.reason == "capacity" else finish.reason,
            prompt_tokens=finish.usage.prompt_tokens,
            completion_tokens=finish.usage.completion_tokens,
            stream=stream,
            timings_seconds=dict(timing),
        )

    def sent(self) -> None:
        self._go(Trigger.SENT)

    # ---- the ways out ------------------------------------------------------------------

    def refused(
        self, now: float, *, status: int, kind: str, code: str | None, param: str | None
    ) -> None:
        self._go(
            Trigger.REFUSED,
            status=status,
            type=kind,
            code=code,
            param=param,
            elapsed_seconds=now - self.arrival,
        )

    def _cancelled_fields(self, now: float) -> dict[str, Any]:
        if self.stage is Stage.RESPOND:
            return {}
        queued = (
            self.admitted_at - self.prepared_at
            if self.admitted_at is not None and self.prepared_at is not None
            else None
        )
        return {"elapsed_seconds": now - self.arrival, "queue_seconds": queued}

    def gone(self, now: float, *, cause: str | None = None) -> None:
        """The client went away (in RESPOND: the settled outcome stands); `cause` where
        it was not simply its leaving: a resumable stream `abandoned` (nobody came back
        for it in time), `stopped` (DELETE /v1/stream) or `replaced` (by a newer
        generation of its conversation)."""
        fields = self._cancelled_fields(now)
        if fields and cause is not None:
            fields["cause"] = cause
        self._go(Trigger.GONE, **fields)

    def cut(self, now: float) -> None:
        """The server's shutdown ended the request before its outcome was settled:
        request_cancelled with `cause: shutdown` (in RESPOND: the outcome stands)."""
        fields = self._cancelled_fields(now)
        if fields:
            fields["cause"] = "shutdown"
        self._go(Trigger.GONE, **fields)

    def stalled(self, now: float) -> None:
        """The client stopped reading for the write timeout."""
        fields = self._cancelled_fields(now)
        if fields:
            fields["stage"] = "write_stalled"
        self._go(Trigger.STALLED, **fields)

    def failed(self, *, status: int, kind: str, message: str) -> None:
        self._go(Trigger.FAILED, status=status, type=kind, message=message)
