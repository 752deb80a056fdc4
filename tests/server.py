"""Every way a test runs ninfer, each for what it is about:

- `serve`: the real server (Hypercorn's trio worker, ninfer's Hypercorn adapter) on a
  loopback port, for what needs sockets and HTTP framing: streams read as they come,
  clients that stall or leave, body limits on the wire, connections, status lines;
- `serve_model`: the same app with a model's real engine thread (the tiny GGUF the
  suite writes, or the default model), called in-process through httpx's ASGI
  transport (each answer whole, a stream's frames at once), for what the protocols
  answer with a real engine behind them;
- `serve_app`: the app over tests/fakeengine.py's FakeEngine through the same
  transport, for refusal tables and shapes that need no model;
- `running_app` (with fakeengine's AsgiClient): the app driven through memory
  channels on Trio's autojump clock, a stream's frames as the app writes them, for
  the request flow's stages and times.

`Server.client()`, `.openai()` and `.anthropic()` give an httpx client and the SDKs'
async clients for whichever of the first three runs it."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import hypercorn.config
import hypercorn.trio
import trio
from hangguard import hang_guard

from ninfer._app import App
from ninfer._config import build_config
from ninfer._hypercorn import adapt_hypercorn

# For a socket operation on a fake engine; a real engine's server is guarded by
# hangguard (no progress, not elapsed time).
SERVER_HANG_GUARD_S = 120


@attrs.frozen
class Server:
    url: str
    app: App
    log_path: Path
    transport: httpx.AsyncBaseTransport | None = None  # None: over the loopback socket

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 60.0)
        if self.transport is not None:
            kwargs.pop("limits", None)  # no connections to limit in process
            kwargs["transport"] = self.transport
        return httpx.AsyncClient(base_url=self.url, **kwargs)

    def openai(self, api_key: str = "unused", **kwargs: Any) -> Any:
        """The OpenAI SDK's async client for this server (over its transport when
        in-process)."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0,
            http_client=self.client() if self.transport is not None else None, **kwargs,
        )  # fmt: skip

    def anthropic(self, api_key: str = "unused", **kwargs: Any) -> Any:
        """The Anthropic SDK's async client for this server (likewise)."""
        import anthropic

        http_client = None
        if self.transport is not None:  # (the SDK takes its own httpx fork's client)
            import httpx2

            transport = httpx2.ASGITransport(app=self.app, client=("127.0.0.1", 1234))
            http_client = httpx2.AsyncClient(base_url=self.url, transport=transport)
        return anthropic.AsyncAnthropic(
            base_url=self.url, api_key=api_key, max_retries=0, http_client=http_client, **kwargs
        )

    def log_records(self) -> list[dict[str, Any]]:
        """The request log's records: while the server runs, every one emitted so far
        (the log's writer thread has written them), not only those it got to."""
        import orjson

        assert self.app.lifespan.log.written(SERVER_HANG_GUARD_S), "the log writer is stuck"
        return [orjson.loads(line) for line in self.log_path.read_bytes().splitlines() if line]


def _app(model: Path, tmp_path: Path, engine: Any, settings: dict[str, Any]) -> tuple[App, Path]:
    """The app `serve` and `serve_model` run, and where its request log goes."""
    log_path = tmp_path / f"requests-{id(settings)}.jsonl"
    values: dict[str, Any] = {
        "model": str(model),
        "port": 0,
        "request_log_jsonl": str(log_path),
        "log_stats_interval_ms": 0,
        "threads": 2,
        **settings,
    }
    return App(build_config(values), argv=["test"], engine=engine), log_path


@asynccontextmanager
async def serve(
    model: Path,
    tmp_path: Path,
    *,
    keep_alive_timeout: float = 5.0,
    engine: Any = None,
    **settings: Any,
) -> AsyncIterator[Server]:
    """Serve `model` with the given settings on 127.0.0.1:<free port> until the block ends
    (`keep_alive_timeout`: Hypercorn's, as `ninfer serve` leaves it by default; `engine`:
    an engine host in place of the model's, e.g. tests/fakeengine.py's)."""
    app, log_path = _app(model, tmp_path, engine, settings)
    adapt_hypercorn()  # as `ninfer serve` does before it serves
    hconfig = hypercorn.config.Config()
    hconfig.bind = ["127.0.0.1:0"]
    hconfig.graceful_timeout = 5.0
    hconfig.keep_alive_timeout = keep_alive_timeout
    hconfig.accesslog = None
    stop = trio.Event()
    with hang_guard():
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(hypercorn.trio.serve, app, hconfig, shutdown_trigger=stop.wait)
            )
            await app.lifespan.settled.wait()
            try:
                yield Server(url=binds[0], app=app, log_path=log_path)
            finally:
                stop.set()
    validate_log(log_path)


@asynccontextmanager
async def serve_model(
    model: Path, tmp_path: Path, *, engine: Any = None, **settings: Any
) -> AsyncIterator[Server]:
    """`serve`'s app and settings, with `model`'s real engine (or `engine`), called
    in-process through httpx's ASGI transport: no socket, no Hypercorn. The request
    log is checked against its schema as `serve` checks it."""
    app, log_path = _app(model, tmp_path, engine, settings)
    async with _in_process(app, log_path) as srv:
        yield srv


@asynccontextmanager
async def serve_app(
    tmp_path: Path, *, engine: Any = None, **settings: Any
) -> AsyncIterator[Server]:
    """The app `serve` runs, with its lifespan, called in-process through httpx's ASGI
    transport (a whole answer at a time; no socket, no Hypercorn) over `engine` (default:
    tests/fakeengine.py's FakeEngine, whose tokenizer is one token a character). The
    request log is checked against its schema as `serve` checks it."""
    from fakeengine import FakeEngine

    log_path = tmp_path / f"requests-{id(settings)}.jsonl"
    values: dict[str, Any] = {
        "model": "fake",
        "request_log_jsonl": str(log_path),
        "log_stats_interval_ms": 0,
        **settings,
    }
    app = App(build_config(values), argv=["test"], engine=engine or FakeEngine())
    async with _in_process(app, log_path) as srv:
        yield srv


@asynccontextmanager
async def _in_process(app: App, log_path: Path) -> AsyncIterator[Server]:
    """`app` running its lifespan, called through httpx's ASGI transport; its request log
    checked against the schema once it has stopped."""
    with hang_guard():
        async with app_running(app):
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 1234))
            yield Server(url="http://ninfer.test", app=app, log_path=log_path,
                         transport=transport)  # fmt: skip
    validate_log(log_path)


@asynccontextmanager
async def running_app(tmp_path: Path, engine: Any, **settings: Any) -> AsyncIterator[App]:
    """The app over `engine` (a FakeEngine), between its lifespan's startup and
    shutdown, for tests that drive it through memory channels (fakeengine's
    AsgiClient) on Trio's autojump clock; the request log at tmp_path/requests.jsonl."""
    values: dict[str, Any] = {
        "model": "fake",
        "request_log_jsonl": str(tmp_path / "requests.jsonl"),
        "log_stats_interval_ms": 0,
        **settings,
    }
    app = App(build_config(values), argv=["test"], engine=engine)
    async with app_running(app):
        yield app


async def wait_for(predicate: Any) -> None:
    """Poll a condition of the server's state, every virtual millisecond: on the autojump
    clock that is free and deterministic (the state has no event to wait on)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.001)


@asynccontextmanager
async def app_running(app: App) -> AsyncIterator[App]:
    """`app` between its ASGI lifespan's startup (the model loaded, admitting) and its
    shutdown, driven through memory channels as a server would drive it."""
    to_app, app_receive = trio.open_memory_channel[dict[str, Any]](2)
    app_send, from_app = trio.open_memory_channel[dict[str, Any]](2)
    lifespan = {"type": "lifespan", "asgi": {"version": "3.0"}}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, lifespan, app_receive.receive, app_send.send)
        await to_app.send({"type": "lifespan.startup"})
        assert (await from_app.receive())["type"] == "lifespan.startup.complete"
        await app.lifespan.settled.wait()
        yield app  # a test that fails leaves by cancelling the app instead
        await to_app.send({"type": "lifespan.shutdown"})
        assert (await from_app.receive())["type"] == "lifespan.shutdown.complete"


def validate_log(path: Path) -> None:
    """Every line the server wrote is one object valid against the shipped schema."""
    import importlib.resources

    import jsonschema
    import orjson

    schema = orjson.loads(
        importlib.resources.files("ninfer").joinpath("request_log.schema.json").read_bytes()
    )
    validator = jsonschema.Draft202012Validator(schema)
    lines = path.read_bytes().splitlines()
    assert lines, "the server wrote no log lines"
    for n, line in enumerate(lines, 1):
        errors = sorted(validator.iter_errors(orjson.loads(line)), key=str)
        assert not errors, f"{path.name}:{n}: {errors[0].message}"


async def stalled_stream(url: str, rid: str) -> trio.socket.SocketType:
    """A streaming request from a client with a tiny receive window that never reads:
    once the server's socket buffers fill, its writes stall."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    body = b'{"prompt": "x", "max_new_tokens": 3500, "ignore_eos": true, "stream": true}'
    await sock.send(
        b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: " + rid.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )
    return sock


async def start_process(
    cmd: list[str], console: bytearray | None = None, **options: Any
) -> tuple[trio.Process, str]:
    """Start `ninfer serve` in a process of its own (`options`: open_process's) and read
    the URL it binds from its console (what it has printed so far is left in
    `console`)."""
    proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE, **options)
    assert proc.stderr is not None
    buf = console if console is not None else bytearray()
    while True:
        chunk = await proc.stderr.receive_some()
        assert chunk, buf.decode(errors="replace")
        buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            # said as soon as the port is open, before the model is loaded
            if "listening on http://" in line and "the model is loading" in line:
                return proc, line.split("listening on ")[1].split(";")[0]


async def until_ready(c: httpx.AsyncClient) -> None:
    # Polling another process over HTTP: there is no event to wait on.
    while (await c.get("/ready")).status_code != 200:  # noqa: ASYNC110
        await trio.sleep(0.05)
