"""The JSONL request log and the console lines, through structlog.

Each event is one JSON object on one line, appended to `--request-log-jsonl` and
flushed per event. Rendering happens on the caller's thread (cheap: orjson);
the write and flush happen on a writer thread of the log's own, so the Trio
thread never waits on the disk. Every line carries `schema`, `schema_version`,
`event`, `ts_unix_ms`, `server_instance_id` and `request_id` (null for
server-level events). Never prompt or output text; never the API key.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import IO, Any, TextIO

import orjson
import structlog
from structlog.typing import EventDict, FilteringBoundLogger

from ninfer._errors import ConfigError

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RequestLog", "console_logger"]

SCHEMA = "ninfer.request_log"
SCHEMA_VERSION = 1

_STOP = object()
# Records waiting for the writer thread at most (~1 KiB each): past this the log is
# not keeping up (or has failed), and records are dropped and counted, never piled up.
MAX_QUEUED = 10_000
_INFO = 20  # the stdlib level number structlog filters by
_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


class _QueueLogger:
    """A structlog logger whose 'output' is a bounded queue the writer thread drains."""

    def __init__(self, q: queue.Queue[object], on_drop: Callable[[], None]) -> None:
        self._q = q
        self._on_drop = on_drop

    def msg(self, message: str) -> None:
        try:
            self._q.put_nowait(message)
        except queue.Full:
            self._on_drop()

    info = warning = error = msg


def _orjson_str(obj: Any, **_kw: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()


def console_logger(stream: TextIO | None = None) -> Any:
    """The console's one format, for every line the server prints (its own, the
    engine's, and Hypercorn's under `ninfer serve`): local time, level, event, then
    key=value fields; each line one write (never split by another thread's)."""
    return structlog.wrap_logger(
        structlog.WriteLogger(stream or sys.stderr),  # one write per line
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=False, sort_keys=False),
        ],
    )


class RequestLog:
    """One per server. `emit` never blocks; `close` drains and flushes."""

    def __init__(self, path: str | None, *, console: TextIO | None = None) -> None:
        self.instance_id = uuid.uuid4().hex
        self._q: queue.Queue[object] = queue.Queue(MAX_QUEUED)
        self._file: IO[bytes] | None = None
        self.failure: str | None = None  # why the log stopped being written, once it has
        self.dropped = 0  # records not written: the queue was full, or the log had failed
        self._drop_lock = threading.Lock()
        if path is not None:
            try:
                self._file = open(path, "ab")  # noqa: SIM115 - owned until close()
                self._start_on_a_new_line()
            except OSError as exc:
                raise ConfigError(
                    f"--request-log-jsonl {path}: cannot open for appending ({exc.strerror})"
                ) from None
        self._json = structlog.wrap_logger(
            _QueueLogger(self._q, self._count_drop),
            processors=[structlog.processors.JSONRenderer(serializer=_orjson_str)],
        )
        self._console = console_logger(console)
        self._listeners: list[Callable[[str, Mapping[str, Any]], None]] = []
        self._writer: threading.Thread | None = None
        if self._file is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="request-log", daemon=True
            )
            self._writer.start()

    def _start_on_a_new_line(self) -> None:
        """A process that died mid-line left a partial last line: the next record must
        not be glued to it (readers skip the partial line, with a note)."""
        assert self._file is not None
        if self._file.tell() > 0:
            with open(self._file.name, "rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    self._file.write(b"\n")
                    self._file.flush()

    def _count_drop(self) -> None:
        with self._drop_lock:
            self.dropped += 1

    def _write_loop(self) -> None:
        assert self._file is not None
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):  # `written`: everything before it is
                item.set()
                continue
            assert isinstance(item, str)
            if self.failure is not None:
                self._count_drop()  # drained, so that memory stays bounded
                continue
            try:
                self._file.write(item.encode() + b"\n")
                self._file.flush()
            except (OSError, ValueError) as exc:  # disk full, file gone, EIO...
                self.failure = f"{type(exc).__name__}: {exc}"
                self._count_drop()
                # Once, on the console: the log is no longer complete.
                self._console.error(
                    "request_log_failed", error=self.failure, effect="records are dropped"
                )

    def subscribe(self, listener: Callable[[str, Mapping[str, Any]], None]) -> None:
        """Call `listener(event, fields)` for every event, whether or not a file is set.

        Listeners run on the emitting thread and must be cheap and never raise.
        """
        self._listeners.append(listener)

    def emit(self, event: str, request_id: str | None = None, **fields: Any) -> None:
        """Append one record (when a file is configured) and tell the listeners."""
        for listener in self._listeners:
            listener(event, fields)
        if self._file is None:
            return
        record = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "event": event,
            "ts_unix_ms": time.time() * 1000.0,
            "server_instance_id": self.instance_id,
            "request_id": request_id,
            **fields,
        }
        self._json.info(**record)

    def console(self, message: str, *, level: str = "info", **fields: Any) -> None:
        """A human-readable line on stderr, in the console's one format."""
        getattr(self._console, level if level in _LEVELS else "info")(message, **fields)

    def diagnostics(self) -> FilteringBoundLogger:
        """The server's and the engine's diagnostics (callable from any thread): each is
        a console line and a `diagnostic` record in the JSONL log with its level, its
        event and its fields; `.exception(...)` (or exc_info=True) adds the traceback as
        `exception`. The one logging system of the process: no stdlib loggers."""
        logger: FilteringBoundLogger = structlog.wrap_logger(
            None,
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.format_exc_info,
                self._diagnostic,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(_INFO),
        )
        return logger

    def _diagnostic(self, _logger: Any, _method: str, event_dict: EventDict) -> EventDict:
        fields = dict(event_dict)
        level = str(fields.pop("level", "info"))
        event = str(fields.pop("event", ""))
        request_id = fields.pop("request_id", None)
        shown = {"request_id": request_id, **fields} if request_id else fields
        getattr(self._console, level if level in _LEVELS else "info")(event, **shown)
        self.emit("diagnostic", request_id, level=level, message=event, **fields)
        raise structlog.DropEvent

    def written(self, timeout: float) -> bool:
        """Wait until every record emitted before this call is in the file (flushed):
        whether that happened within `timeout` seconds. A reader of a live server's
        log (its tests) calls this first; `close` drains the same way at shutdown."""
        if self._writer is None:
            return True
        marker = threading.Event()
        self._q.put(marker)  # may wait for room: the writer drains without blocking
        return marker.wait(timeout)

    def close(self) -> None:
        if self._writer is not None:
            self._q.put(_STOP)  # may wait for room: the writer drains without blocking
            self._writer.join()
            self._writer = None
        if self._file is not None:
            with contextlib.suppress(OSError):  # a failed log's close fails the same way
                self._file.close()
            self._file = None
