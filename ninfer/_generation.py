"""One generation request's life on the Trio side, for every protocol.

arrival -> a place in the scheduler (429 when full) -> body under a byte limit and
a read deadline (413, 408) -> protocol-specific preparation (parse, validate,
render, tokenize, budget: 4xx) -> FIFO admission for a slot and KV pages under the
absolute pending deadline (503) -> the engine -> the response, streamed or whole.
A sibling task watches for the client going away at every stage after the body;
a write watchdog cancels a request whose client stopped reading. Exactly one
terminal log record per request: done, rejected, error or cancelled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from ninfer._http import (
    ClientGone,
    Headers,
    discard_body,
    read_body,
    send_bytes,
    worth_draining,
)
from ninfer._messages import Finish, GenerationRequest, RequestHandle, TokenDelta
from ninfer._requestlog import RequestLog
from ninfer._service import EngineService
from protocols import ApiError
from scheduler import AdmissionController, Overloaded, Ticket

__all__ = ["GenerationContext", "Outcome", "Prepared", "Responder", "run_generation"]

_log = logging.getLogger("ninfer.request")

# How long a refused request's unread body may take to arrive before the answer.
DISCARD_BODY_S = 1.0


@attrs.frozen
class Prepared:
    """What a protocol's preparation produces: the engine request and how to answer."""

    request: GenerationRequest
    stream: bool
    warnings: tuple[str, ...] = ()
    log_fields: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Outcome:
    """The finished generation, for building a response."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish
    timing: dict[str, float]


class Responder(Protocol):
    """The protocol-specific half: error envelopes, stream frames, the final body."""

    content_type_stream: bytes

    def error(self, err: ApiError, request_id: str) -> bytes: ...

    def error_status(self, err: ApiError) -> int: ...

    def stream_head(self, prepared: Prepared, request_id: str) -> list[bytes]: ...

    def stream_delta(self, delta: TokenDelta, request_id: str) -> list[bytes]: ...

    def stream_tail(self, outcome: Outcome, prepared: Prepared) -> list[bytes]: ...

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]: ...

    def body(self, outcome: Outcome, prepared: Prepared) -> bytes: ...


@attrs.frozen
class GenerationContext:
    """What the app hands to each generation request."""

    scheduler: AdmissionController
    service: EngineService
    log: RequestLog
    max_request_bytes: int
    read_timeout_s: float
    write_timeout_s: float
    pending_timeout_s: float
    pages_needed: Callable[[int, int], int]
    is_draining: Callable[[], bool]
    # (seconds since the previous tokens, how many arrived): the inter-token metric.
    on_tokens: Callable[[float, int], None] = lambda _s, _n: None


def error_headers(err: ApiError, request_id_header: bytes, request_id: str) -> Headers:
    headers: Headers = [(request_id_header, request_id.encode())]
    if err.retry_after is not None:
        headers.append((b"retry-after", str(err.retry_after).encode()))
    if err.allow:
        headers.append((b"allow", ", ".join(err.allow).encode()))
    if err.kind == "payload_too_large" or err.kind == "request_timeout":
        headers.append((b"connection", b"close"))
    return headers


class _Writer:
    """Sends ASGI messages and notices when one has been in flight for too long."""

    def __init__(self, send: ASGISendCallable, timeout: float) -> None:
        self._send = send
        self.timeout = timeout
        self.in_flight_since: float | None = None
        self.completed = 0
        self.started = False

    async def send(self, message: Any) -> None:
        self.in_flight_since = trio.current_time()
        await self._send(message)
        self.in_flight_since = None
        self.completed += 1

    async def watch(self, on_stall: Callable[[], None]) -> None:
        """Call `on_stall` once one send has been in flight for `timeout` seconds."""
        while True:
            since = self.in_flight_since
            if since is None:
                # Nothing in flight: look again in `timeout`. A send that starts meanwhile
                # has its deadline after that look, so it is still caught on time.
                await trio.sleep(self.timeout)
                continue
            seen = self.completed
            await trio.sleep_until(since + self.timeout)
            if self.in_flight_since == since and self.completed == seen:
                on_stall()
                return


async def run_generation(
    ctx: GenerationContext,
    *,
    scope: HTTPScope,
    receive: ASGIReceiveCallable,
    send: ASGISendCallable,
    request_id: str,
    request_id_header: bytes,
    endpoint: str,
    responder: Responder,
    prepare: Callable[[bytes], Awaitable[Prepared]],
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    arrival = trio.current_time()
    deadline = arrival + ctx.pending_timeout_s
    run = _Run(
        ctx, scope, receive, send, request_id, request_id_header, endpoint, responder, arrival
    )
    run.extra_headers = list(extra_headers)
    try:
        if ctx.is_draining():
            raise ApiError("shutting_down", "the server is shutting down", retry_after=1)
        try:
            ticket = ctx.scheduler.enter()
        except Overloaded as exc:
            raise ApiError(
                "server_overloaded",
                "the server is at capacity; retry after the time in Retry-After",
                retry_after=exc.retry_after,
            ) from None
        with ticket:
            await run.serve(ticket, prepare, deadline)
    except ApiError as err:
        await run.reject(err)
    except ClientGone as gone:
        run.log_cancelled(gone.stage)


class _Run:
    def __init__(
        self,
        ctx: GenerationContext,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
        request_id_header: bytes,
        endpoint: str,
        responder: Responder,
        arrival: float,
    ) -> None:
        self.ctx = ctx
        self.scope = scope
        self.receive = receive
        self.writer = _Writer(send, ctx.write_timeout_s)
        self.request_id = request_id
        self.rid_header = request_id_header
        self.endpoint = endpoint
        self.responder = responder
        self.arrival = arrival
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.stage = "body"
        self.body_read = False
        self.started = False  # request_start logged
        self.terminal_logged = False
        self.handle: RequestHandle | None = None
        self.prepared_at = arrival
        self.admitted_at = arrival
        self.admitted = False
        self.first_token_at: float | None = None

    # ---- terminal records -----------------------------------------------------------

    def _terminal(self, event: str, **fields: Any) -> None:
        if self.terminal_logged:
            return
        self.terminal_logged = True
        self.ctx.log.emit(event, self.request_id, endpoint=self.endpoint, **fields)

    def log_cancelled(self, stage: str) -> None:
        self._terminal(
            "request_cancelled",
            stage=stage,
            elapsed_seconds=trio.current_time() - self.arrival,
            queue_seconds=self.admitted_at - self.prepared_at if self.admitted else None,
        )

    async def reject(self, err: ApiError) -> None:
        status = self.responder.error_status(err)
        if status >= 500 and err.kind == "internal_error":
            self._terminal("request_error", status=status, type=err.kind, message=err.message)
        else:
            self._terminal(
                "request_rejected",
                status=status,
                type=err.kind,
                code=err.code,
                param=err.param,
                phase=self.stage,
                elapsed_seconds=trio.current_time() - self.arrival,
            )
        if self.writer.started:
            return  # the stream already began; its error event was sent
        if not self.body_read and worth_draining(self.scope, err.kind):
            await discard_body(self.receive, self.ctx.max_request_bytes, DISCARD_BODY_S)
        body = self.responder.error(err, self.request_id)
        headers = error_headers(err, self.rid_header, self.request_id) + self.extra_headers
        with trio.move_on_after(self.ctx.write_timeout_s):
            await send_bytes(self.writer._send, status, body, headers)

    # ---- the flow -------------------------------------------------------------------------

    async def serve(
        self, ticket: Ticket, prepare: Callable[[bytes], Awaitable[Prepared]], deadline: float
    ) -> None:
        body = await read_body(
            self.scope,
            self.receive,
            self.ctx.max_request_bytes,
            self.arrival + self.ctx.read_timeout_s,
        )
        self.body_read = True
        self.stage = "prepare"
        prepared = await prepare(body)
        self.prepared_at = trio.current_time()
        req = prepared.request
        self.ctx.log.emit(
            "request_start",
            self.request_id,
            endpoint=self.endpoint,
            prompt_tokens=len(req.prompt_ids),
            max_new_tokens=req.max_new_tokens,
            stream=prepared.stream,
            sampling=attrs.asdict(req.sampling),
            stop_count=len(req.stop),
            ignore_eos=req.ignore_eos,
            **prepared.log_fields,
        )
        self.started = True
        gone: list[bool] = []
        failure: ApiError | None = None
        async with trio.open_nursery() as nursery:
            work = trio.CancelScope()
            nursery.start_soon(_watch_disconnect, self.receive, work, gone)
            nursery.start_soon(self.writer.watch, lambda: self._stalled(ticket, work))
            with work:
                try:
                    await self._admit_and_generate(ticket, prepared, deadline)
                except ApiError as err:
                    failure = err  # re-raised below, outside the nursery's exception group
                except ClientGone:
                    gone.append(True)  # the connection broke while we wrote to it
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if gone:
            if self.handle is not None:
                self.ctx.service.cancel(self.handle)
            self.log_cancelled(self.stage)

    def _stalled(self, ticket: Ticket, work: trio.CancelScope) -> None:
        """The client stopped reading: free the slot and pages now, whatever send does."""
        if self.handle is not None:
            self.ctx.service.cancel(self.handle)
        ticket.release()
        self.log_cancelled("write_stalled")
        work.cancel()

    async def _admit_and_generate(
        self, ticket: Ticket, prepared: Prepared, deadline: float
    ) -> None:
        req = prepared.request
        units = self.ctx.pages_needed(len(req.prompt_ids), req.max_new_tokens)
        self.stage = "queued"
        with trio.move_on_at(deadline) as queue_scope:
            await self.ctx.scheduler.admit(ticket, units)
        if queue_scope.cancelled_caught:
            retry = max(1, math.ceil(self.ctx.scheduler.retry_after()))
            raise ApiError(
                "request_queue_timeout",
                f"the request waited {self.ctx.pending_timeout_s:g}s without being admitted",
                retry_after=retry,
            )
        self.admitted_at = trio.current_time()
        self.admitted = True
        try:
            self.handle, events = self.ctx.service.submit(req)
        except Exception as exc:  # the engine stopped or refused: not the client's fault
            raise ApiError("internal_error", "the engine is not accepting requests") from exc
        self.stage = "prefill"
        token_ids: list[int] = []
        texts: list[str] = []
        finish: Finish | None = None
        last_at = self.admitted_at
        try:
            if prepared.stream:
                await self._start_stream(prepared)
            async with events:
                async for event in events:
                    self.ctx.service.consumed(self.handle, events.statistics().current_buffer_used)
                    if isinstance(event, TokenDelta):
                        now = trio.current_time()
                        if self.first_token_at is None:
                            self.first_token_at = now
                            self.stage = "decode"
                        elif event.token_ids:
                            self.ctx.on_tokens(now - last_at, len(event.token_ids))
                        last_at = now
                        token_ids.extend(event.token_ids)
                        texts.append(event.text)
                        if prepared.stream:
                            for frame in self.responder.stream_delta(event, self.request_id):
                                await self._frame(frame)
                    else:
                        finish = event
        finally:
            if finish is None and self.handle is not None:
                self.ctx.service.cancel(self.handle)
        if finish is None or finish.reason == "error":
            detail = finish.error if finish is not None else "the engine stopped"
            _log.error("request %s failed in the engine: %s", self.request_id, detail)
            err = ApiError("internal_error", "generation failed inside the server")
            self._terminal(
                "request_error",
                status=500,
                type="internal_error",
                message=detail,
                stage=self.stage,
            )
            if prepared.stream:
                for frame in self.responder.stream_error(err, self.request_id):
                    await self._frame(frame)
                await self.writer.send(
                    {"type": "http.response.body", "body": b"", "more_body": False}
                )
                return
            raise err
        outcome = Outcome(
            request_id=self.request_id,
            token_ids=token_ids,
            text="".join(texts),
            finish=finish,
            timing=self._timing(finish),
        )
        self.stage = "respond"
        # The outcome is settled: log it before writing, so a client that closes as
        # soon as it has read the last byte does not turn it into a cancellation.
        self._log_done(outcome, prepared)
        if prepared.stream:
            for frame in self.responder.stream_tail(outcome, prepared):
                await self._frame(frame)
            await self.writer.send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body = self.responder.body(outcome, prepared)
            total_ms = outcome.timing["total"] * 1000
            headers = [
                (self.rid_header, self.request_id.encode()),
                (b"server-timing", f"total;dur={total_ms:.3f}".encode()),
                *self.extra_headers,
            ]
            await self.writer.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        *headers,
                    ],
                    "trailers": False,
                }
            )
            await self.writer.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _start_stream(self, prepared: Prepared) -> None:
        headers = [
            (b"content-type", self.responder.content_type_stream),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (self.rid_header, self.request_id.encode()),
            *self.extra_headers,
        ]
        await self.writer.send(
            {"type": "http.response.start", "status": 200, "headers": headers, "trailers": False}
        )
        self.writer.started = True
        for frame in self.responder.stream_head(prepared, self.request_id):
            await self._frame(frame)

    async def _frame(self, frame: bytes) -> None:
        await self.writer.send({"type": "http.response.body", "body": frame, "more_body": True})

    def _timing(self, finish: Finish) -> dict[str, float]:
        now = trio.current_time()
        t = finish.timings
        ttft = (self.first_token_at or now) - self.arrival
        return {
            "prepare": self.prepared_at - self.arrival,
            "queue": (self.admitted_at - self.prepared_at) + t.wait_s,
            "ttft": ttft,
            "prefill": t.prefill_s,
            "decode": t.decode_s,
            "total": now - self.arrival,
        }

    def _log_done(self, outcome: Outcome, prepared: Prepared) -> None:
        f = outcome.finish
        self._terminal(
            "request_done",
            finish_reason=f.reason,
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            stream=prepared.stream,
            timings_seconds=outcome.timing,
        )


async def _watch_disconnect(
    receive: ASGIReceiveCallable, work: trio.CancelScope, gone: list[bool]
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            work.cancel()
            return
