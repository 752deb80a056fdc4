"""The bridge between Trio and the engine thread: the only module that knows both.

`EngineService.run` (a long-lived task of the app's nursery) starts the engine
thread, which loads the model and then serves. Events leave the engine thread
once per step through `TrioToken.run_sync_soon` (the engine never waits for the
event loop) and are dispatched on the Trio thread into one memory channel per
request with `send_nowait`. Each channel's buffer holds the request's whole
output budget plus its finish event, so the dispatcher can never block; a
closed receiver (the request task is gone) turns into an engine cancel.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable

import attrs
import trio

from ninfer._engine import Engine, EngineConfig, EngineStatistics
from ninfer._errors import EngineStopped
from ninfer._loader import LoadedModel
from ninfer._messages import Event, Finish, GenerationRequest, RequestHandle, TokenDelta

__all__ = ["EngineService", "ServiceState"]

_log = logging.getLogger("ninfer.service")

SWITCH_INTERVAL_S = 0.0005
# A request whose reader has this many undelivered events is left out of decode steps
# until it has taken all but RESUME_BACKLOG of them: a client that stops reading costs the
# others nothing, and one that reads slowly is served at its own pace.
PAUSE_BACKLOG = 64
RESUME_BACKLOG = 8


@attrs.frozen
class ServiceState:
    phase: str  # loading | ready | failed | stopped
    error: str | None
    stalled: bool


class _TrioSink:
    """Runs on the engine thread: hands each step's events to the Trio thread."""

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


class EngineService:
    # A step with requests in flight that has not completed for this long marks the
    # engine as stalled (/ready answers 503).
    STALL_SECONDS = 30.0

    def __init__(self, loader: Callable[[], LoadedModel], config: EngineConfig) -> None:
        self._loader = loader
        self._config = config
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self._channels: dict[int, trio.MemorySendChannel[Event]] = {}
        self._paused: set[int] = set()
        self._phase = "loading"
        self._error: str | None = None
        self._ready = trio.Event()
        self.generated_tokens = 0  # counted on dispatch, for the throughput log

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine thread and serve until `shutdown`; started() comes at once, so
        the server answers /health while the model loads."""
        token = trio.lowlevel.current_trio_token()
        # The engine thread runs Python between torch calls while holding the GIL; with
        # the default 5 ms switch interval every syscall of the event loop (each accept,
        # read and write) can wait that long to get the GIL back, and a burst of requests
        # queues behind it. A shorter interval keeps the event loop responsive.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        engine = Engine(self._loader, self._config, _TrioSink(token, self._dispatch))
        self.engine = engine
        task_status.started()

        def on_ready(model: LoadedModel) -> None:
            token.run_sync_soon(self._mark_ready, model)

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                engine.shutdown()  # never blocks; the thread's loop returns at its next step

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_when_cancelled)
                # Not abandoned on cancel: a cancelled caller waits for the thread to stop.
                await trio.to_thread.run_sync(
                    engine.run, on_ready, limiter=trio.CapacityLimiter(1), abandon_on_cancel=False
                )
                nursery.cancel_scope.cancel()
            self._phase = "stopped"
        except Exception as exc:
            self._phase = "failed"
            self._error = f"{type(exc).__name__}: {exc}"
            _log.exception("the engine thread died")
            # Not re-raised: the server stays up to say so (/ready answers 503) and
            # every request in flight has already received its error finish.
        finally:
            self._ready.set()
            self._close_all()

    def _mark_ready(self, model: LoadedModel) -> None:
        self.model = model
        self._phase = "ready"
        self._ready.set()

    async def wait_loaded(self) -> None:
        await self._ready.wait()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def state(self) -> ServiceState:
        stalled = False
        if self._phase == "ready" and self.engine is not None:
            st = self.engine.statistics()
            stalled = st.busy and time.monotonic() - st.last_progress > self.STALL_SECONDS
        return ServiceState(phase=self._phase, error=self._error, stalled=stalled)

    def statistics(self) -> EngineStatistics | None:
        return self.engine.statistics() if self.engine is not None else None

    # ---- requests -----------------------------------------------------------------------

    def submit(
        self, request: GenerationRequest
    ) -> tuple[RequestHandle, trio.MemoryReceiveChannel[Event]]:
        """Queue a request; its events arrive on the returned channel, ending with Finish."""
        if self._phase != "ready" or self.engine is None:
            raise EngineStopped(f"the engine is {self._phase}")
        # Room for one TokenDelta per output token plus the Finish: never blocks.
        send, receive = trio.open_memory_channel[Event](request.max_new_tokens + 2)
        handle = self.engine.submit(request)
        self._channels[handle.id] = send
        return handle, receive

    def cancel(self, handle: RequestHandle) -> None:
        if handle.id in self._channels and self.engine is not None:
            self.engine.cancel(handle)

    def _dispatch(self, events: list[tuple[RequestHandle, Event]]) -> None:
        """On the Trio thread, once per engine step. Must never raise."""
        try:
            for handle, event in events:
                send = self._channels.get(handle.id)
                if send is None:
                    continue
                if isinstance(event, TokenDelta):
                    self.generated_tokens += len(event.token_ids)
                try:
                    send.send_nowait(event)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # The request task is gone: stop computing for it.
                    del self._channels[handle.id]
                    self._paused.discard(handle.id)
                    send.close()
                    if not isinstance(event, Finish) and self.engine is not None:
                        self.engine.cancel(handle)
                    continue
                except trio.WouldBlock:
                    _log.error("event channel full for %s; cancelling", handle.request_id)
                    del self._channels[handle.id]
                    self._paused.discard(handle.id)
                    send.close()
                    if self.engine is not None:
                        self.engine.cancel(handle)
                    continue
                if isinstance(event, Finish):
                    del self._channels[handle.id]
                    send.close()
                    self._paused.discard(handle.id)
                elif (
                    handle.id not in self._paused
                    and send.statistics().current_buffer_used >= PAUSE_BACKLOG
                    and self.engine is not None
                ):
                    self._paused.add(handle.id)
                    self.engine.pause(handle, True)
        except Exception:
            _log.exception("event dispatch failed")

    def paused_requests(self) -> int:
        """How many requests are left out of decode steps for a reader that fell behind."""
        return len(self._paused)

    def consumed(self, handle: RequestHandle, backlog: int) -> None:
        """The request task took an event and `backlog` remain: resume a paused request
        once its reader has caught up."""
        if handle.id in self._paused and backlog <= RESUME_BACKLOG and self.engine is not None:
            self._paused.discard(handle.id)
            self.engine.pause(handle, False)

    def _close_all(self) -> None:
        for send in self._channels.values():
            send.close()
        self._channels.clear()
