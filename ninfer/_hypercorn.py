"""Where ninfer reaches into Hypercorn: the two changes it makes to Hypercorn's own
classes, applied once per process by whatever runs the server (`ninfer serve`, the
`create_app` factory Hypercorn's CLI calls, the tests' server), never by an `App`.

ASGI has no field for either, so each wraps one of Hypercorn's methods:

- `TCPServer.run` (trio worker): a request task can close its own connection
  (`abort`). Hypercorn shields each socket write from cancellation, so a request
  whose client stopped reading would otherwise keep its task, its socket and its
  unsent bytes until the client left.
- `H11Protocol._send_h11_event`: HTTP/1.1 status lines carry their reason phrase
  (`HTTP/1.1 429 Too Many Requests`); Hypercorn writes none (`HTTP/1.1 429 `), which
  clients accept (RFC 9112 lets them ignore it) but people reading `curl -i` or a
  proxy's log miss.

Both are private methods: they were written for the Hypercorn versions in
HYPERCORN_VERSIONS (pyproject.toml requires the same range; a test holds the two
equal), and another version is refused when the server starts, not patched blindly.

Hypercorn's own process (the one that spawns workers, and that a supervisor watches)
never imports the app. It reads `--config python:ninfer.app.hypercorn_config`, and that
object (`master_config`) is what ninfer does there: it checks ninfer's settings and its
model (fetched into the cache if it is a registered name, else a GGUF file that exists)
before any worker is spawned, as `ninfer serve` does (a bad one is one line and exit
status 2), and keeps a worker's
exit status, which Hypercorn's `run()` drops (`hypercorn.run._join_exited` is called a
second time on the emptied list of workers and returns 0: pgjones/hypercorn#269), so
that a worker that fails at start fails the command.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.metadata
import os
import sys
import types
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from ninfer._artifacts import cache_dir, resolve_model
from ninfer._config import config_from_env
from ninfer._errors import ConfigError, NinferError

__all__ = ["HYPERCORN_VERSIONS", "abort", "adapt_hypercorn", "master_config"]

# The versions the two wrappers were written and tested for: at least the first,
# below the second (pyproject.toml's requirement: hypercorn>=0.17,<0.19).
HYPERCORN_VERSIONS = ((0, 17), (0, 19))

# The connection an ASGI call came in on (Hypercorn's trio TCPServer), for `abort`.
_CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar("ninfer_connection")


def _release(version: str) -> tuple[int, int]:
    major, minor, *_ = (int(part) for part in [*version.split(".")[:2], "0", "0"])
    return major, minor


def check_version(version: str) -> None:
    """Raise ConfigError when `version` is outside HYPERCORN_VERSIONS."""
    low, high = HYPERCORN_VERSIONS
    if not low <= _release(version) < high:
        want = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        raise ConfigError(
            f"Hypercorn {version} is installed; ninfer's server was written for "
            f"hypercorn{want} (it wraps two of Hypercorn's private methods): "
            f"pip install 'hypercorn{want}'"
        )


def adapt_hypercorn() -> None:
    """Apply both wrappers, once per process (again: nothing). Raises ConfigError for a
    Hypercorn outside HYPERCORN_VERSIONS."""
    check_version(importlib.metadata.version("hypercorn"))
    import h11
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.tcp_server import TCPServer

    run = TCPServer.run
    if not getattr(run, "ninfer", False):

        async def tracked(self: TCPServer) -> None:
            _CONNECTION.set(self)  # the request tasks it starts inherit it
            await run(self)

        tracked.ninfer = True  # type: ignore[attr-defined]
        TCPServer.run = tracked  # type: ignore[method-assign]

    send = H11Protocol._send_h11_event
    if not getattr(send, "ninfer", False):

        async def with_reason(self: H11Protocol, event: Any) -> None:
            if isinstance(event, h11.Response | h11.InformationalResponse) and not event.reason:
                with contextlib.suppress(ValueError):  # a code without a registered phrase
                    phrase = HTTPStatus(event.status_code).phrase.encode()
                    event = dataclasses.replace(event, reason=phrase)
            await send(self, event)

        with_reason.ninfer = True  # type: ignore[attr-defined]
        H11Protocol._send_h11_event = with_reason  # type: ignore[method-assign]


async def abort() -> bool:
    """Close the connection the current request came in on, whatever its writes wait
    for (a write blocked on it fails, and Hypercorn ends the exchange). False where
    the request did not come through an adapted Hypercorn (in-process ASGI)."""
    server = _CONNECTION.get(None)
    if server is None:
        return False
    await server.stream.aclose()
    return True


def master_config() -> types.SimpleNamespace:
    """What `hypercorn --config python:ninfer.app.hypercorn_config` reads, in Hypercorn's
    own process, before it spawns a worker: ninfer's settings (NINFER_* variables and
    NINFER_CONFIG's file) and its model checked there as `ninfer serve` checks them (the
    model fetched into the cache where it is a registered name), a refused one printed
    as one line and exit status 2; a worker's exit status kept
    (`keep_worker_exit_status`); and the settings Hypercorn takes from it: the trio
    worker class (a flag on the command line wins)."""
    try:
        check_version(importlib.metadata.version("hypercorn"))
        config = config_from_env(os.environ)
        resolve_model(config.model, cache_dir(config.cache_dir, os.environ),
                      progress=lambda line: print(f"ninfer: {line}", file=sys.stderr))  # fmt: skip
    except NinferError as exc:
        print(f"ninfer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    keep_worker_exit_status()
    return types.SimpleNamespace(worker_class="trio")


def keep_worker_exit_status() -> None:
    """Make Hypercorn's `run()` return the first non-zero exit status a worker had
    (once per process). Its loop reads each exited worker's status with `_join_exited`
    and stops on a failure, then calls `_join_exited` again on the list it emptied,
    which returns 0, and `hypercorn` exits 0 after its worker failed."""
    import hypercorn.run

    real: Callable[[list[Any]], int] = hypercorn.run._join_exited
    if getattr(real, "ninfer_keeps_status", False):
        return
    failed: list[int] = []

    def join_exited(processes: list[Any]) -> int:
        status = real(processes)
        if status != 0 and not failed:
            failed.append(status)
        return status or (failed[0] if failed else 0)

    join_exited.ninfer_keeps_status = True  # type: ignore[attr-defined]
    hypercorn.run._join_exited = join_exited
