"""`ninfer serve`'s server: the app on Hypercorn's trio worker, in the shape of
Hypercorn's own `worker_serve`: one nursery owns the signal watcher, the engine watch
and `hypercorn.trio.serve`. SIGTERM or SIGINT drains (new requests refused, the running
ones finished within --graceful-timeout-s); an engine that fails to load or dies ends
the process with status 1; clients that hold the drain up past its deadline are cut.
Hypercorn's own lines are written in the console's one format."""

from __future__ import annotations

import os
import signal
import socket
import traceback
from typing import Any

import hypercorn.config
import hypercorn.logging
import hypercorn.trio
import trio

from ninfer._app import App
from ninfer._config import ServerConfig
from ninfer._hypercorn import adapt_hypercorn

__all__ = ["address_taken", "hypercorn_console", "serve"]


def address_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (in use, not an address here), or None.
    Port 0 (any free port) is never taken."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds
        try:
            s.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def hypercorn_console(console: Any) -> type[Any]:
    """Hypercorn's logger class, its lines ("Running on ...", errors it catches) written
    in the console's one format by `console` (a structlog logger), never interleaved
    with the server's own."""

    class ConsoleLogger(hypercorn.logging.Logger):
        async def log(self, level: int, message: str, *args: Any, **kwargs: Any) -> None:
            name = {10: "debug", 20: "info", 30: "warning", 40: "error"}.get(level, "critical")
            if level < 20:
                return
            text = message % args if args else message
            if text.startswith("Running on ") and text.endswith(" (CTRL + C to quit)"):
                # Said before the model is loaded (or found to be bad): say so. `ready`
                # follows when requests are served.
                where = text.removeprefix("Running on ").removesuffix(" (CTRL + C to quit)")
                text = f"listening on {where}; the model is loading (CTRL + C to quit)"
            if kwargs.get("exc_info"):
                text += "\n" + traceback.format_exc().rstrip()
            getattr(console, name)(text)

        async def critical(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(50, message, *args, **kwargs)

        async def error(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(40, message, *args, **kwargs)

        async def warning(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(30, message, *args, **kwargs)

        async def info(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(20, message, *args, **kwargs)

        async def debug(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(10, message, *args, **kwargs)

        async def exception(self, message: str, *args: Any, **kwargs: Any) -> None:
            await self.log(40, message, *args, exc_info=True, **kwargs)

    return ConsoleLogger


def serve(app: App, config: ServerConfig, console: Any) -> int:
    """Serve `app` on `config`'s address until a signal's drain ends or the engine
    fails; the exit status (0, or 1 when the engine failed). Raises ConfigError for a
    Hypercorn that ninfer's wrappers were not written for."""
    adapt_hypercorn()
    hconfig = hypercorn.config.Config()
    host, port = config.host, config.port
    hconfig.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hconfig.graceful_timeout = config.graceful_timeout_s
    hconfig.accesslog = None
    hconfig.errorlog = None  # no stdlib logger of Hypercorn's own: the class below prints
    hconfig.logger_class = hypercorn_console(console)
    # Past the graceful timeout, a request whose write is stuck on a client that stopped
    # reading is cancelled once its own write timeout has passed; a few seconds more,
    # and the process ends whatever clients do.
    hard_deadline_s = config.graceful_timeout_s + config.write_timeout_s + 5.0
    exit_code = 0

    async def main() -> None:
        stop = trio.Event()

        async def force_exit_later() -> None:
            await trio.sleep(hard_deadline_s)
            console.warning("clients held the shutdown up; stopping now")
            app.force_stop()
            os._exit(0)

        async def signals(nursery: trio.Nursery) -> None:
            # SIGTERM and SIGINT alike, for the whole shutdown: a second one does not
            # cut the streams being finished (no KeyboardInterrupt).
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for _ in received:
                    if stop.is_set():
                        console.info("already draining")
                        continue
                    app.lifespan.begin_drain()
                    nursery.start_soon(force_exit_later)
                    stop.set()

        async def engine_watch() -> None:
            nonlocal exit_code
            await app.lifespan.service.failed.wait()  # failed to load, or died later
            exit_code = 1
            stop.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(signals, nursery)
            nursery.start_soon(engine_watch)
            await hypercorn.trio.serve(app, hconfig, shutdown_trigger=stop.wait)
            nursery.cancel_scope.cancel()  # served and drained: the watchers end with it

    trio.run(main)
    return exit_code
