"""The bridge between Trio and the engine: the only server module that starts the
engine's torch side.

`EngineService.run` (a long-lived task of the app's nursery) runs an `EngineHost`:
in production `ThreadedEngine`, which imports torch, makes the process settings and
loads the model on a thread of its own; in tests a fake that runs inside Trio. Events
leave the engine once per step through `TrioToken.run_sync_soon` (the engine never
waits for the event loop) and are dispatched on the Trio thread into one memory
channel per request with `send_nowait`. Each channel's buffer holds the request's
whole output budget plus its finish event, so the dispatcher can never block; a
closed receiver (the request task is gone) turns into an engine cancel. A reader that
falls far behind is paused out of decode steps until it catches up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import attrs
import trio
from structlog.typing import FilteringBoundLogger

from ninfer._errors import EngineStopped, NinferError
from ninfer.engine import (
    EngineConfig,
    EngineStatistics,
    Event,
    EventSink,
    Finish,
    GenerationRequest,
    RequestHandle,
    ServedModel,
    TokenDelta,
)

__all__ = ["EngineHost", "EngineService", "ServiceState", "ThreadedEngine", "build_native_kernels"]

# A request whose reader has this many undelivered events is left out of decode steps
# until it has taken all but RESUME_BACKLOG of them: a client that stops reading costs the
# others nothing, and one that reads slowly is served at its own pace.
PAUSE_BACKLOG = 64
RESUME_BACKLOG = 8


def build_native_kernels(cache: str, progress: Callable[[str], None]) -> tuple[str | None, str]:
    """Build the engine's native kernels (`ninfer build-kernels`): the library's path, or
    None and why none was built. Imports torch."""
    from pathlib import Path

    from ninfer.engine._kernels import build_kernels

    built = build_kernels(Path(cache), progress=progress)
    return (str(built.path) if built.path is not None else None), built.reason


class EngineHost(Protocol):
    """An engine as the bridge drives it. `submit`, `cancel`, `pause` and `shutdown`
    never block; events reach the sink given to `run`, once per step."""

    async def run(self, sink: EventSink, on_ready: Callable[[ServedModel], None]) -> None:
        """Load, serve until `shutdown`, return; raise when the engine dies."""
        ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def pause(self, handle: RequestHandle, paused: bool) -> None: ...

    def shutdown(self) -> None: ...

    def statistics(self) -> EngineStatistics | None: ...


class ThreadedEngine:
    """The torch engine on an OS thread of its own. torch is imported, the process
    settings made and the model loaded on that thread, when `run` starts it."""

    def __init__(
        self,
        model_path: Callable[[], str],
        config: EngineConfig,
        *,
        threads: int | None,
        log: FilteringBoundLogger,
        progress: Callable[[str], None],
    ) -> None:
        self._model_path = model_path
        self._config = config
        self._threads = threads
        self._log = log
        self._progress = progress
        self._engine: _TorchEngine | None = None
        self._stop_requested = False

    async def run(self, sink: EventSink, on_ready: Callable[[ServedModel], None]) -> None:
        # Not abandoned on cancel: a cancelled caller waits for the thread to stop.
        await trio.to_thread.run_sync(
            self._thread_main,
            sink,
            on_ready,
            limiter=trio.CapacityLimiter(1),
            abandon_on_cancel=False,
        )

    def _thread_main(self, sink: EventSink, on_ready: Callable[[ServedModel], None]) -> None:
        from ninfer.engine._runtime import configure_process, create_engine

        configure_process(threads=self._threads)
        engine = create_engine(
            self._model_path, self._config, sink, log=self._log, progress=self._progress
        )
        self._engine = engine
        if self._stop_requested:
            engine.shutdown()
        engine.run(on_ready)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self._engine is None:
            raise EngineStopped("the engine is not running")
        return self._engine.submit(request)

    def cancel(self, handle: RequestHandle) -> None:
        if self._engine is not None:
            self._engine.cancel(handle)

    def pause(self, handle: RequestHandle, paused: bool) -> None:
        if self._engine is not None:
            self._engine.pause(handle, paused)

    def shutdown(self) -> None:
        self._stop_requested = True
        if self._engine is not None:
            self._engine.shutdown()

    def statistics(self) -> EngineStatistics | None:
        return self._engine.statistics() if self._engine is not None else None


class _TorchEngine(Protocol):
    """What ThreadedEngine uses of `ninfer.engine._engine.Engine` (named here without
    importing it, so that importing the bridge does not import torch)."""

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def pause(self, handle: RequestHandle, paused: bool) -> None: ...

    def shutdown(self) -> None: ...

    def statistics(self) -> EngineStatistics: ...


@attrs.frozen
class ServiceState:
    phase: str  # loading | ready | failed | stopped
    error: str | None
    stalled: bool


def _root_cause(exc: BaseException) -> BaseException:
    """The exception itself, out of the one-exception groups nurseries wrap it in."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class _TrioSink:
    """Called on the engine's side: hands each step's events to the Trio thread."""

    def __init__(
        self,
        token: trio.lowlevel.TrioToken,
        dispatch: Callable[[list[tuple[RequestHandle, Event]]], None],
    ) -> None:
        self._token = token
        self._dispatch = dispatch

    def deliver(self, events: list[tuple[RequestHandle, Event]]) -> None:
        # When the event loop is gone, nobody is waiting for these events.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._dispatch, events)


# The engine is stalled (/ready and new requests answer 503) when no step has finished
# while work waited for longer than STALL_FACTOR times the slowest of its recent steps,
# and at least STALL_FLOOR_S: a machine so loaded that every step takes seconds is slow,
# not stalled, while an engine stuck in one step is found within a fixed bound.
STALL_FLOOR_S = 30.0
STALL_FACTOR = 10.0


def is_stalled(st: EngineStatistics, now: float) -> bool:
    limit = max(STALL_FLOOR_S, STALL_FACTOR * st.slowest_recent_step)
    return st.busy and now - st.last_progress > limit


class EngineService:
    """The engine as the request tasks see it: submit for a channel of events."""

    def __init__(self, host: EngineHost, *, log: FilteringBoundLogger) -> None:
        self._host = host
        self._log = log
        self.model: ServedModel | None = None
        self._channels: dict[int, trio.MemorySendChannel[Event]] = {}
        self._paused: set[int] = set()
        self._phase = "loading"
        self._error: str | None = None
        self._ready = trio.Event()
        self.failed = trio.Event()  # set when the engine fails to load or dies

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until `shutdown`; started() comes at once, so the server
        answers /health while the model loads."""
        token = trio.lowlevel.current_trio_token()
        task_status.started()

        def on_ready(model: ServedModel) -> None:
            token.run_sync_soon(self._mark_ready, model)

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                self._host.shutdown()  # never blocks; the engine returns at its next step

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_when_cancelled)
                await self._host.run(_TrioSink(token, self._dispatch), on_ready)
                nursery.cancel_scope.cancel()
            self._phase = "stopped"
        except Exception as exc:
            root = _root_cause(exc)
            self._phase = "failed"
            self._error = f"{type(root).__name__}: {root}"
            # Our own errors (a bad model file, a config refused) say all there is to say;
            # anything else is a bug, and its traceback goes to the console and the log.
            trace = None if isinstance(root, NinferError) else root
            self._log.error("engine_died", error=self._error, exc_info=trace)
            self.failed.set()
            # Not re-raised: the server stays up to say so (/ready answers 503) and
            # every request in flight has already received its error finish.
        finally:
            self._ready.set()
            self._close_all()

    def _mark_ready(self, model: ServedModel) -> None:
        self.model = model
        self._phase = "ready"
        self._ready.set()

    async def wait_loaded(self) -> None:
        await self._ready.wait()

    def shutdown(self) -> None:
        self._host.shutdown()

    def state(self) -> ServiceState:
        stalled = False
        if self._phase == "ready":
            st = self._host.statistics()
            stalled = st is not None and is_stalled(st, time.monotonic())
        return ServiceState(phase=self._phase, error=self._error, stalled=stalled)

    def statistics(self) -> EngineStatistics | None:
        return self._host.statistics()

    # ---- requests -----------------------------------------------------------------------

    def submit(
        self, request: GenerationRequest
    ) -> tuple[RequestHandle, trio.MemoryReceiveChannel[Event]]:
        """Queue a request; its events arrive on the returned channel, ending with Finish."""
        if self._phase != "ready":
            raise EngineStopped(f"the engine is {self._phase}")
        # Room for every event the request can receive (GenerationRequest.events_bound):
        # never blocks.
        send, receive = trio.open_memory_channel[Event](request.events_bound)
        handle = self._host.submit(request)
        self._channels[handle.id] = send
        return handle, receive

    def cancel(self, handle: RequestHandle) -> None:
        if handle.id in self._channels:
            self._host.cancel(handle)

    def _drop(self, handle: RequestHandle, send: trio.MemorySendChannel[Event]) -> None:
        del self._channels[handle.id]
        self._paused.discard(handle.id)
        send.close()

    def _dispatch(self, events: list[tuple[RequestHandle, Event]]) -> None:
        """On the Trio thread, once per engine step. Must never raise."""
        try:
            for handle, event in events:
                send = self._channels.get(handle.id)
                if send is None:
                    continue
                try:
                    send.send_nowait(event)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # The request task is gone: stop computing for it.
                    self._drop(handle, send)
                    if not isinstance(event, Finish):
                        self._host.cancel(handle)
                    continue
                except trio.WouldBlock:
                    self._log.error("event_channel_full", request_id=handle.request_id)
                    self._drop(handle, send)
                    self._host.cancel(handle)
                    continue
                if isinstance(event, Finish):
                    self._drop(handle, send)
                elif (
                    isinstance(event, TokenDelta)
                    and handle.id not in self._paused
                    and send.statistics().current_buffer_used >= PAUSE_BACKLOG
                ):
                    self._paused.add(handle.id)
                    self._host.pause(handle, True)
        except Exception:
            self._log.exception("event_dispatch_failed")

    def paused_requests(self) -> int:
        """How many requests are left out of decode steps for a reader that fell behind."""
        return len(self._paused)

    def consumed(self, handle: RequestHandle, backlog: int) -> None:
        """The request task took an event and `backlog` remain: resume a paused request
        once its reader has caught up."""
        if handle.id in self._paused and backlog <= RESUME_BACKLOG:
            self._paused.discard(handle.id)
            self._host.pause(handle, False)

    def _close_all(self) -> None:
        for send in self._channels.values():
            send.close()
        self._channels.clear()
