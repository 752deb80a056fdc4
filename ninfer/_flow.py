"""One generation request's life on the Trio side, for any frontend.

A place in the scheduler (429 when full) -> the body under a byte limit and a read
deadline (413, 408) -> the frontend's preparation (4xx) -> FIFO admission for a slot
and KV pages under the absolute pending deadline (503) -> the engine -> the answer,
streamed or whole. Each step is a transition of the request's `Lifecycle`, which
writes its records. A sibling task watches for the client going away until the
outcome is settled; a write watchdog cancels a request whose client stopped reading.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio
from hypercorn.typing import ASGISendEvent, HTTPScope

from ninfer._estimate import Progress, ServiceTimes
from ninfer._http import (
    ClientGone,
    Exchange,
    header,
    read_body,
    send_refusal,
)
from ninfer._hypercorn import abort
from ninfer._lifecycle import Lifecycle, Stage, Trigger
from ninfer._requestlog import RequestLog
from ninfer._streams import OffsetLost, StreamSession, StreamSessions, conversation_id
from ninfer.engine import (
    GRAMMAR_LIMIT,
    KV_MEMORY,
    CompiledGrammar,
    Event,
    Finish,
    GenerationRequest,
    PromptProgress,
    RequestHandle,
    TokenDelta,
    TokenLogprob,
)
from ninfer.frontends import (
    Answer,
    Choice,
    FailingAnswer,
    Frontend,
    Outcome,
    Prepared,
    ProgressAnswer,
)
from protocols import ApiError
from scheduler import AdmissionController, Overloaded, Ticket

__all__ = ["EngineChannel", "FlowContext", "serve_generation", "serve_replay"]


class EngineChannel(Protocol):
    """The engine as a request task uses it (the bridge's EngineService)."""

    def submit(
        self, request: GenerationRequest
    ) -> tuple[RequestHandle, trio.MemoryReceiveChannel[Event]]: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def consumed(self, handle: RequestHandle, backlog: int) -> None: ...


@attrs.frozen
class FlowContext:
    """What the app hands to each generation request."""

    scheduler: AdmissionController
    engine: EngineChannel
    log: RequestLog
    max_request_bytes: int
    read_timeout_s: float
    write_timeout_s: float
    pending_timeout_s: float
    pages_needed: Callable[[int, int], int]
    draining: Callable[[], ApiError | None]  # the refusal while the server drains
    service_times: ServiceTimes  # sizes each ticket for the scheduler's estimates
    # who a request's client is, as the scheduler tells clients apart (its address)
    client_of: Callable[[HTTPScope], str | None] = lambda _scope: None
    # (seconds since the previous tokens, how many arrived): the inter-token metric.
    on_tokens: Callable[[float, int], None] = lambda _s, _n: None
    # Resumable streams (X-Conversation-Id; ninfer._streams); None: none.
    streams: StreamSessions | None = None


class _Writer:
    """Sends ASGI messages and notices when one has been in flight for too long. A
    resumable stream's body bytes also go to its session (`tee`); once its client is
    gone (`detached`), only there."""

    def __init__(
        self,
        exchange: Exchange,
        timeout: float,
        tee: StreamSession | None = None,
        on_gone: Callable[[], None] = lambda: None,
    ) -> None:
        self._exchange = exchange
        self.timeout = timeout
        self.in_flight_since: float | None = None
        self.completed = 0
        self.tee = tee
        self.detached = False
        self._on_gone = on_gone  # a resumable stream's client went away (a failed write)

    async def send(self, message: ASGISendEvent) -> None:
        if self.tee is not None and message["type"] == "http.response.body":
            self.tee.append(message["body"])
        if self.detached:
            return
        self.in_flight_since = trio.current_time()
        try:
            await self._exchange.send(message)
        except ClientGone:
            if self.tee is None:
                raise
            self._on_gone()  # the answer goes on into the session
            return
        finally:  # a write cancelled before it began is not one stuck on the client
            self.in_flight_since = None
        self.completed += 1

    async def frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            await self.send({"type": "http.response.body", "body": frame, "more_body": True})

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
                # The write cannot be cancelled (Hypercorn shields it): the connection
                # is closed under it, so that the request ends now, and is logged.
                await abort()
                return


async def serve_generation(
    ctx: FlowContext,
    frontend: Frontend,
    scope: HTTPScope,
    exchange: Exchange,
    life: Lifecycle,
) -> None:
    """Serve one generation request; its lifecycle is routed and ends decided."""
    run = _Run(ctx=ctx, frontend=frontend, scope=scope, exchange=exchange, life=life)
    life.routed()
    try:
        refusal = ctx.draining()
        if refusal is not None:
            raise refusal
        try:
            ticket = ctx.scheduler.enter(
                returning=_returning(scope),
                promise=header(scope, b"x-ninfer-no-promise") is None,
                token=_retry_token(scope),
                client=ctx.client_of(scope),
            )
        except Overloaded as exc:
            raise ApiError(
                "server_overloaded",
                "the server is at capacity; retry after the time in Retry-After",
                retry_after=exc.retry_after,
                retry_token=exc.token,
            ) from None
        with ticket:
            await run.serve(ticket)
    except ApiError as err:
        await run.refuse(err)
    except ClientGone:
        if not life.decided:
            life.gone(trio.current_time())
    except BaseException as exc:
        if _cancellation(exc):
            # Only the server's shutdown cancels a request task (clients' leaving and
            # the watchdogs cancel scopes of its own): one record, and a stream under
            # way gets its protocol's error frames first, unless a write is stuck.
            await run.cut_by_shutdown()
        raise


_UNANSWERED = ("error", "cancelled")
# Retry-After when a request's KV pages found no memory: engine_unavailable's (errors.md).
KV_MEMORY_RETRY_S = 5.0


def _returning(scope: HTTPScope) -> bool | None:
    """Whether the client says this is a retry: the OpenAI and Anthropic SDKs (and the
    others generated like them) send `x-stainless-retry-count`, 0 on a first attempt.
    A first attempt never takes a place promised to a refused client."""
    count = header(scope, b"x-stainless-retry-count")
    if count is None:
        return None
    return count.strip() != b"0"


def _retry_token(scope: HTTPScope) -> str | None:
    """The promise a retry claims (`ninfer-retry-token`, as the 429 gave it; any other
    value, `new` on a first attempt, says the client speaks tokens and holds none), or
    None for a client that does not send the header (docs/scheduler.md, "Tokens")."""
    value = header(scope, b"ninfer-retry-token")
    if value is None:
        return None
    token = value.strip()
    return token.decode("ascii") if 0 < len(token) <= 64 and token.isascii() else ""


def _logged_sampling(req: GenerationRequest) -> dict[str, Any]:
    """request_start's `sampling`: the parameters, logit_bias as its entry count, a
    grammar (structured outputs, tools) as its size: never the client's schemas."""
    fields = attrs.asdict(req.sampling)
    bias = fields.pop("logit_bias")
    if bias:
        fields["logit_bias_count"] = len(bias)
    fields.pop("grammar")
    grammar = req.sampling.grammar
    if grammar is not None:
        text = grammar if isinstance(grammar, str) else grammar.text
        fields["grammar_bytes"] = len(text.encode("utf-8", "surrogatepass"))
    return fields


def _cancellation(exc: BaseException) -> bool:
    """A trio.Cancelled, alone or in the exception group a nursery wrapped it in."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


@attrs.define(eq=False)
class _Sequence:
    """One choice's events as they arrive."""

    token_ids: list[int] = attrs.Factory(list)
    texts: list[str] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finish: Finish | None = None

    def add(self, delta: TokenDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.texts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def done(self, index: int) -> Choice:
        assert self.finish is not None
        return Choice(
            index,
            self.token_ids,
            "".join(self.texts),
            self.finish,
            self.logprobs,
            self.prompt_logprobs,
        )


@attrs.define(eq=False)
class _Run:
    ctx: FlowContext
    frontend: Frontend
    scope: HTTPScope
    exchange: Exchange
    life: Lifecycle
    handles: list[RequestHandle] = attrs.Factory(list)  # one per choice, once submitted
    work: trio.CancelScope = attrs.Factory(trio.CancelScope)  # generation and its answer
    client_gone: bool = False  # noted by the disconnect watcher or a failed write
    stalled: bool = False  # noted by the write watchdog
    progress: Progress | None = None  # the ticket's tag: how far the request has come
    last_at: float = 0.0  # when tokens last arrived (for the inter-token metric)
    answer: Answer | None = None  # once prepared
    writer: _Writer = attrs.field(init=False)
    # A resumable stream's session (X-Conversation-Id), and the nursery its watchers run in
    session: StreamSession | None = None
    nursery: trio.Nursery | None = None
    # request_cancelled's cause where it was not the client's leaving: abandoned (nobody
    # resumed its stream in time), stopped (DELETE /v1/stream), replaced
    cause: str | None = None

    def __attrs_post_init__(self) -> None:
        self.writer = _Writer(self.exchange, self.ctx.write_timeout_s, on_gone=self._detach)

    async def cut_by_shutdown(self) -> None:
        """Record a request the shutdown ends (request_cancelled, cause shutdown) and end
        a stream under way with its protocol's error frames. Shielded and bounded; never
        raises (the cancellation being handled goes on)."""
        life = self.life
        if not life.allows(Trigger.GONE):
            return
        began = bool(self.exchange.status) and life.stage in (Stage.PREFILL, Stage.DECODE)
        life.cut(trio.current_time())
        if not began or self.writer.in_flight_since is not None:
            return  # no stream, or a write stuck on the client: nothing more can go out
        cut = ApiError("shutting_down", "the server shut down before the answer ended")
        frames = self._stream_error(cut)
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(1.0),
            contextlib.suppress(ClientGone),
        ):
            await self.writer.frames(frames)
            await self.writer.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def refuse(self, err: ApiError) -> None:
        """Record a refusal (or an internal failure) and answer it, unless the response
        has already begun (a stream's error frames were sent)."""
        if not self.life.decided:
            status = self.frontend.dialect.status(err)
            if err.kind == "internal_error":
                self.life.failed(status=status, kind=err.kind, message=err.message)
            else:
                self.life.refused(
                    trio.current_time(),
                    status=status,
                    kind=err.kind,
                    code=err.code,
                    param=err.param,
                )
        if self.exchange.status:
            return
        with trio.move_on_after(self.ctx.write_timeout_s):
            await send_refusal(
                self.exchange,
                self.scope,
                self.frontend.dialect,
                err,
                self.life.request_id,
                max_request_bytes=self.ctx.max_request_bytes,
            )

    # ---- the flow -------------------------------------------------------------------------

    async def serve(self, ticket: Ticket) -> None:
        life, ctx = self.life, self.ctx
        body = await read_body(
            self.scope,
            self.exchange.receive,
            ctx.max_request_bytes,
            life.arrival + ctx.read_timeout_s,
        )
        life.body_read()
        prepared = await self.frontend.prepare(body, life.request_id)
        req = prepared.request
        prompt_tokens = sum(len(r.prompt_ids) for r in prepared.requests)
        self.progress = ctx.service_times.track(
            ticket, prompt_tokens, req.max_new_tokens * len(prepared.requests)
        )
        extra: dict[str, Any] = (
            {"choices": len(prepared.requests)} if len(prepared.requests) > 1 else {}
        )
        conv = conversation_id(header(self.scope, b"x-conversation-id"))
        if prepared.stream and conv is not None and ctx.streams and ctx.streams.enabled:
            self.session = ctx.streams.open(conv, self._stop)
            extra["resumable"] = True
        if req.embed is not None:  # its own record: its inputs and pooling (log_fields)
            life.prepared(
                trio.current_time(),
                prompt_tokens=prompt_tokens,
                stream=False,
                **prepared.log_fields,
            )
        else:
            life.prepared(
                trio.current_time(),
                prompt_tokens=prompt_tokens,
                max_new_tokens=req.max_new_tokens,
                stream=prepared.stream,
                sampling=_logged_sampling(req),
                stop_count=len(req.stop),
                ignore_eos=req.ignore_eos,
                **extra,
                **prepared.log_fields,
            )
        failure: ApiError | None = None
        if self.session is not None:
            self.writer.tee = self.session
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._watch_disconnect)
                nursery.start_soon(self.writer.watch, lambda: self._stalled(ticket))
                with self.work:
                    try:
                        await self._admit_and_generate(ticket, prepared)
                    except ApiError as err:
                        failure = err  # re-raised below, outside the nursery's group
                    except ClientGone:
                        self._gone()  # the connection broke while we wrote to it
                nursery.cancel_scope.cancel()
        finally:  # however it ended (a shutdown's cancellation too): nobody reads on
            self.nursery = None
            for handle in self.handles:
                ctx.engine.cancel(handle)  # a no-op once the engine has finished it
            if self.session is not None and ctx.streams is not None:
                ctx.streams.close(self.session)  # its readers see the end
        # Only this task moves the lifecycle: the watchers above just noted what they saw
        # (the work may have run on to its next checkpoint after they cancelled it).
        now = trio.current_time()
        if self.stalled and life.allows(Trigger.STALLED):
            life.stalled(now)
        elif self.client_gone and life.allows(Trigger.GONE):
            life.gone(now, cause=self.cause)
        if failure is not None:
            raise failure  # refuse() records it unless the outcome is already decided
        if life.stage is Stage.RESPOND:
            life.gone(now)  # cancelled while answering: the settled outcome stands

    def _gone(self) -> None:
        """The client went away: until the outcome is settled, that cancels the work;
        after, the answer being written is simply not read."""
        self.client_gone = True
        if not self.life.decided:
            self.work.cancel()

    def _detach(self) -> None:
        """A resumable stream's client went away: the generation goes on into its
        session while a reader may come back for it (`_watch_abandoned`)."""
        if self.writer.detached:
            return
        self.writer.detached = True
        if self.nursery is not None:
            self.nursery.start_soon(self._watch_abandoned)

    def _stop(self, cause: str) -> None:
        """End the generation for `cause` (its session was stopped or abandoned):
        request_cancelled with that cause, unless the outcome is settled already."""
        self.cause = cause
        self._gone()

    async def _watch_abandoned(self) -> None:
        """Stop the generation once its session has had no reader for --stream-resume-s
        (the seed's rule, with a bounded wait: work nobody waits for is cancelled)."""
        session, streams = self.session, self.ctx.streams
        assert session is not None
        assert streams is not None
        while True:
            if session.readers == 0:
                with trio.move_on_after(streams.resume_s) as waiting:
                    while session.readers == 0:
                        await session.changed()
                if waiting.cancelled_caught:
                    self._stop("abandoned")
                    return
            while session.readers > 0:
                await session.changed()

    def _stalled(self, ticket: Ticket) -> None:
        """The client stopped reading: free the slot and pages now, whatever send does.
        (A resumable stream's generation goes on: the connection is closed under the
        stuck write, which then fails, and the stream is followed in its session.)"""
        if self.session is not None:
            self._detach()
            return
        self.stalled = True
        for handle in self.handles:
            self.ctx.engine.cancel(handle)
        ticket.release()
        self.work.cancel()

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.exchange.receive()
            if message["type"] == "http.disconnect":
                if self.session is not None:
                    self._detach()
                else:
                    self._gone()
                return

    async def _admit_and_generate(self, ticket: Ticket, prepared: Prepared) -> None:
        life, ctx = self.life, self.ctx
        pages = [ctx.pages_needed(len(r.prompt_ids), r.reserved_tokens) for r in prepared.requests]
        wave = prepared.wave or len(pages)
        if prepared.wave:  # at most `wave` inputs in the engine at once: their pages
            pages.sort(reverse=True)
            while wave > 1 and sum(pages[:wave]) > ctx.scheduler.units_total:
                wave -= 1
        units = sum(pages[:wave])
        # a running slot per sequence decoded; an embedding request decodes none: one
        slots = 1 if prepared.wave else len(pages)
        with trio.move_on_at(life.arrival + ctx.pending_timeout_s) as queue_scope:
            await ctx.scheduler.admit(ticket, units, slots)
        if queue_scope.cancelled_caught:
            raise ApiError(
                "request_queue_timeout",
                f"the request waited {ctx.pending_timeout_s:g}s without being admitted",
                retry_after=ctx.scheduler.admitted_in(units),
            )
        life.admitted(trio.current_time())
        answer = self.answer = prepared.answer
        if prepared.wave:
            choices = await self._collect_waves(prepared, wave)
        else:
            streams = [self._submit(req) for req in prepared.requests]
            if prepared.stream:
                await self._start_stream(prepared.headers)
                await self.writer.frames(answer.head())
            choices = await self._collect(streams, prepared)
        # A choice the engine ended without an answer (an error; or cancelled, which only
        # a stopping engine does to a request its reader still waits for) fails them all.
        unanswered = [c for c in choices if c.finish is None or c.finish.reason in _UNANSWERED]
        failed = next((c for c in unanswered if c.finish and c.finish.error), None) or next(
            iter(unanswered), None
        )
        if failed is not None:
            await self._engine_failed(failed.finish, prepared)
            return
        now = trio.current_time()
        finishes = [c.finish for c in choices if c.finish is not None]
        last = max(finishes, key=lambda f: f.timings.prefill_s + f.timings.decode_s)
        outcome = Outcome(
            life.request_id,
            tuple(c.done(i) for i, c in enumerate(choices)),
            prepared.usage(finishes),
            life.timing(last.timings, now),
        )
        counted = [f.speculative for f in finishes if f.speculative is not None]
        life.settled(
            attrs.evolve(
                finishes[0],
                usage=outcome.usage,
                speculative=functools.reduce(operator.add, counted) if counted else None,
            ),
            outcome.timing,
            stream=prepared.stream,
            session=None
            if self.session is None
            else {"client_left": self.writer.detached, "resumes": self.session.resumes},
            inputs=len(choices),
        )
        # The engine has finished with it: its place and pages are free before the last
        # bytes are written, so the answer's reader can be admitted again at once.
        ticket.release()
        if prepared.stream:
            await self.writer.frames(answer.tail(outcome))
            await self.writer.send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body = answer.body(outcome)
            total_ms = outcome.timing["total"] * 1000
            await self._start(
                200,
                [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"server-timing", f"total;dur={total_ms:.3f}".encode()),
                    *prepared.headers,
                ],
            )
            await self.writer.send({"type": "http.response.body", "body": body, "more_body": False})
        life.sent()

    def _submit(self, req: GenerationRequest) -> trio.MemoryReceiveChannel[Event]:
        """Give the engine one of the request's sequences; its events' channel."""
        try:
            handle, events = self.ctx.engine.submit(req)
        except Exception as exc:  # the engine stopped or refused: not the client's fault
            raise ApiError("internal_error", "the engine is not accepting requests") from exc
        self.handles.append(handle)
        return events

    async def _collect_waves(self, prepared: Prepared, wave: int) -> list[_Sequence]:
        """An embedding request's inputs, at most `wave` in the engine at once (the pages
        it was admitted with), the next submitted as each one finishes; after a failure
        none more (the others are cancelled and the request fails)."""
        requests = prepared.requests
        sequences = [_Sequence() for _ in requests]
        send, receive = trio.open_memory_channel[tuple[int, Event]](0)
        submitted = finished = 0
        failed = False
        async with trio.open_nursery() as nursery, send, receive:

            def submit() -> None:
                nonlocal submitted
                events = self._submit(requests[submitted])
                nursery.start_soon(self._forward, submitted, events, send.clone())
                submitted += 1

            while submitted < min(wave, len(requests)):
                submit()
            while finished < submitted:
                i, event = await receive.receive()
                await self._take(i, event, sequences[i], prepared)
                if not isinstance(event, Finish):
                    continue
                finished += 1
                if event.reason in _UNANSWERED:
                    failed = True
                    for handle in self.handles:
                        self.ctx.engine.cancel(handle)
                elif not failed and submitted < len(requests):
                    submit()
        return sequences

    async def _collect(
        self, streams: list[trio.MemoryReceiveChannel[Event]], prepared: Prepared
    ) -> list[_Sequence]:
        """Take every choice's engine events (streaming each delta) up to its Finish.
        Choices decoded together are read through one channel, in arrival order."""
        sequences = [_Sequence() for _ in streams]
        if len(streams) == 1:
            async with streams[0] as events:
                async for event in events:
                    self._consumed(0, events)
                    if await self._take(0, event, sequences[0], prepared):
                        break
            return sequences
        send, receive = trio.open_memory_channel[tuple[int, Event]](0)
        async with trio.open_nursery() as nursery, receive:
            for i, stream in enumerate(streams):
                nursery.start_soon(self._forward, i, stream, send.clone())
            send.close()
            async for i, event in receive:
                await self._take(i, event, sequences[i], prepared)
                if isinstance(event, Finish) and event.reason == "error":
                    for handle in self.handles:  # the request has failed: stop its other
                        self.ctx.engine.cancel(handle)  # choices now (each ends cancelled)
        return sequences

    async def _forward(
        self,
        index: int,
        events: trio.MemoryReceiveChannel[Event],
        out: trio.MemorySendChannel[tuple[int, Event]],
    ) -> None:
        async with events, out:
            async for event in events:
                self._consumed(index, events)
                await out.send((index, event))
                if isinstance(event, Finish):
                    return

    def _consumed(self, index: int, events: trio.MemoryReceiveChannel[Event]) -> None:
        """Tell the engine how far behind the reader of a choice is (a row whose reader
        falls far behind is paused)."""
        self.ctx.engine.consumed(self.handles[index], events.statistics().current_buffer_used)

    async def _take(self, index: int, event: Event, seq: _Sequence, prepared: Prepared) -> bool:
        """Note one event of the choice at `index`; True at its Finish."""
        if isinstance(event, Finish):
            seq.finish = event
            return True
        if isinstance(event, PromptProgress):  # asked for by the answer's request
            if prepared.stream and isinstance(prepared.answer, ProgressAnswer):
                await self.writer.frames(prepared.answer.progress(index, event))
            return False
        now = trio.current_time()
        if self.life.stage is Stage.PREFILL:
            self.life.first_token(now)
        elif event.token_ids:
            self.ctx.on_tokens(now - self.last_at, len(event.token_ids))
        self.last_at = now
        seq.add(event)
        if self.progress is not None:
            self.progress.generated += len(event.token_ids)
        if prepared.stream:
            await self.writer.frames(prepared.answer.delta(index, event))
        return False

    def _stream_error(self, err: ApiError) -> list[bytes]:
        """The frames that end a stream which fails after it began: the answer's own
        where its protocol has them (a Response's response.failed), else the dialect's."""
        if isinstance(self.answer, FailingAnswer):
            return self.answer.failed(err)
        return self.frontend.dialect.stream_error(err, self.life.request_id)

    async def _engine_failed(self, finish: Finish | None, prepared: Prepared) -> None:
        detail = finish.error if finish is not None and finish.error else "the engine stopped"
        grammar = prepared.request.sampling.grammar
        if detail == GRAMMAR_LIMIT and isinstance(grammar, CompiledGrammar):
            # The client's schema, past the grammar engine's limits where decoding
            # reached: its fault, named (a stream already under way ends with it).
            err = ApiError("invalid_request", GRAMMAR_LIMIT, param=grammar.param or None,
                           code="invalid_value")  # fmt: skip
        elif detail == KV_MEMORY:  # the machine's memory, taken by others: not a fault
            err = ApiError("engine_unavailable", f"{KV_MEMORY}; retry later",
                           retry_after=KV_MEMORY_RETRY_S)  # fmt: skip
        else:
            err = ApiError("internal_error", "generation failed inside the server")
        self.life.failed(status=self.frontend.dialect.status(err), kind=err.kind, message=detail)
        if not prepared.stream:
            raise err  # answered by refuse(), which records nothing more
        await self.writer.frames(self._stream_error(err))
        await self.writer.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.writer.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *headers,
                    (self.frontend.dialect.request_id_header, self.life.request_id.encode()),
                ],
                "trailers": False,
            }
        )

    async def _start_stream(self, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        await self._start(
            200,
            [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
                *headers,
            ],
        )


async def serve_replay(
    ctx: FlowContext, exchange: Exchange, session: StreamSession, offset: int, rid: bytes
) -> None:
    """GET /v1/stream: a session's bytes from `offset`, then its live ones to its end, as
    an SSE response. The reader counts as the stream's client while attached: its
    generation is not abandoned meanwhile. A reader that stops reading is cut off after
    --write-timeout-s, as any client; one that falls SESSION_BYTES behind is ended (its
    next resume is refused: the bytes are gone)."""
    writer = _Writer(exchange, ctx.write_timeout_s)
    session.attach()
    try:
        async with trio.open_nursery() as nursery:
            done = nursery.cancel_scope.cancel

            async def disconnect() -> None:
                while (await exchange.receive())["type"] != "http.disconnect":
                    pass
                done()

            nursery.start_soon(disconnect)
            nursery.start_soon(writer.watch, lambda: None)
            await writer.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                        (b"x-request-id", rid),
                    ],
                    "trailers": False,
                }
            )
            try:
                async for chunk in session.read_from(offset):
                    await writer.send(
                        {"type": "http.response.body", "body": chunk, "more_body": True}
                    )
            except OffsetLost:  # fell behind what the session keeps: a broken stream,
                await abort()  # never an end that looks whole
                done()
                return
            await writer.send({"type": "http.response.body", "body": b"", "more_body": False})
            done()
    except ClientGone:
        pass
    finally:
        session.detach()
