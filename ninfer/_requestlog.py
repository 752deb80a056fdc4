"""The JSONL request log and the console lines, through structlog.

Each event is one JSON object on one line, appended to `--request-log-jsonl` and
flushed per event. Rendering happens on the caller's thread (cheap: orjson);
the write and flush happen on a writer thread of the log's own, so the Trio
thread never waits on the disk. Every line carries `schema`, `schema_version`,
`event`, `ts_unix_ms`, `server_instance_id` and `request_id` (null for
server-level events). Never prompt or output text; never the API key.
"""

from __future__ import annotations

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

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RequestLog"]

SCHEMA = "ninfer.request_log"
SCHEMA_VERSION = 1

_STOP = object()
_INFO = 20  # the stdlib level number structlog filters by
_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


class _QueueLogger:
    """A structlog logger whose 'output' is a queue the writer thread drains."""

    def __init__(self, q: queue.SimpleQueue[object]) -> None:
        self._q = q

    def msg(self, message: str) -> None:
        self._q.put(message)

    info = warning = error = msg


def _orjson_str(obj: Any, **_kw: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()


class RequestLog:
    """One per server. `emit` never blocks; `close` drains and flushes."""

    def __init__(self, path: str | None, *, console: TextIO | None = None) -> None:
        self.instance_id = uuid.uuid4().hex
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._file: IO[bytes] | None = None
        if path is not None:
            try:
                self._file = open(path, "ab")  # noqa: SIM115 - owned until close()
            except OSError as exc:
                raise ConfigError(
                    f"--request-log-jsonl {path}: cannot open for appending ({exc.strerror})"
                ) from None
        self._json = structlog.wrap_logger(
            _QueueLogger(self._q),
            processors=[structlog.processors.JSONRenderer(serializer=_orjson_str)],
        )
        self._console = structlog.wrap_logger(
            structlog.PrintLogger(console or sys.stderr),
            processors=[
                structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
        )
        self._listeners: list[Callable[[str, Mapping[str, Any]], None]] = []
        self._writer: threading.Thread | None = None
        if self._file is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="request-log", daemon=True
            )
            self._writer.start()

    def _write_loop(self) -> None:
        assert self._file is not None
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            assert isinstance(item, str)
            self._file.write(item.encode() + b"\n")
            self._file.flush()

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

    def console(self, message: str, **fields: Any) -> None:
        """A human-readable line on stderr."""
        self._console.info(message, **fields)

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

    def close(self) -> None:
        if self._writer is not None:
            self._q.put(_STOP)
            self._writer.join()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None
