"""The ASGI application: the route table and each request's dispatch (CORS, the API key,
the route's dialect for refusals, one request-log record). The table is the server's
own routes (probes, metrics, the contract, /props) and every frontend's
(`ninfer.frontends.FRONTENDS`, each declaring its paths and its dialect). What can be
served, and when, is the lifespan's (`ninfer._lifespan`); generation routes hand their
frontend to the request flow (`ninfer._flow`).

`create_app()` is the factory Hypercorn's trio worker calls
(`hypercorn --worker-class trio 'ninfer.app:create_app()'`); `ninfer serve` builds
the same app from flags and serves it with `hypercorn.trio.serve`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPScope,
    LifespanScope,
    Scope,
    WebsocketScope,
)

from ninfer._bridge import EngineHost
from ninfer._config import ServerConfig, config_from_env
from ninfer._errors import ConfigError
from ninfer._flow import serve_generation, serve_replay
from ninfer._http import (
    ClientGone,
    Exchange,
    authorize,
    cors_origin,
    header,
    preflight,
    read_body,
    request_id_from,
    send_bytes,
    send_refusal,
    with_cors,
)
from ninfer._hypercorn import adapt_hypercorn
from ninfer._lifecycle import Lifecycle, Stage, Trigger
from ninfer._lifespan import Lifespan
from ninfer._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ninfer._streams import StreamSessions
from ninfer.frontends import (
    FRONTENDS,
    Count,
    Frontend,
    FrontendRoute,
    Generate,
    PathArgs,
    Routed,
    server_props,
)
from protocols import ApiError, Dialect, NativeDialect, OpenAIDialect, dumps, loads

__all__ = ["App", "create_app"]

# Token counts served at once (/v1/messages/count_tokens).
COUNT_TOKENS_CONCURRENCY = 2
# Conversations one POST /v1/streams/lookup may name (the web UI names those it lists).
LOOKUP_IDS_MAX = 10_000

Handler = Callable[[HTTPScope, Exchange, Lifecycle, PathArgs], Awaitable[None]]


@attrs.frozen
class Route:
    """One path: its handlers by method, the dialect its refusals speak, whether it
    needs the API key, and whether its refusals are request-log records."""

    methods: Mapping[str, Handler]
    dialect: Dialect
    open: bool = False  # served without the API key (/health, /ready)
    logged: bool = True


def _segments(path: str) -> tuple[str, ...]:
    return tuple(path.split("/")[1:])


def _topic(segments: tuple[str, ...]) -> str:
    """What a path is about: its first segment after `v1`."""
    rest = segments[1:] if segments[:1] == ("v1",) else segments
    return rest[0] if rest else ""


@attrs.define
class RouteTable:
    """Paths to routes. A path is labelled by its route's template (the label metrics and
    the request log use: raw paths are unbounded); `{name}` in a template matches one
    segment (all the rest, for a route declared `rest`). An unversioned protocol's /v1
    routes are also served without `/v1`, labelled as the /v1 route. An unmatched path
    speaks the dialect of the routes about the same thing (`/v1/messages/x`:
    Anthropic's), else the native one."""

    fallback: Dialect
    routes: dict[str, Route] = attrs.Factory(dict)  # by template
    _patterns: list[tuple[tuple[str, ...], bool, str]] = attrs.Factory(list)
    _topics: dict[str, Dialect] = attrs.Factory(dict)

    def add(
        self, path: str, route: Route, *, rest: bool = False, unversioned: bool = False
    ) -> None:
        if path in self.routes:
            raise ValueError(f"two routes for {path}")
        self.routes[path] = route
        segments = _segments(path)
        self._patterns.append((segments, rest, path))
        if unversioned and segments[0] == "v1":
            self._patterns.append((segments[1:], rest, path))
        # A literal segment wins over a parameter: /v1/responses/input_tokens is not a
        # stored Response's id.
        self._patterns.sort(key=lambda p: (sum(s.startswith("{") for s in p[0]), p[1]))
        self._topics.setdefault(_topic(segments), route.dialect)

    def resolve(self, path: str) -> tuple[str, Route | None, Dialect, dict[str, str]]:
        """The path's label (`unmatched` when no route has it), its route, the dialect
        its refusals speak and the template's parameters."""
        parts = _segments(path)
        for template, rest, label in self._patterns:
            params = _match(template, rest, parts)
            if params is not None:
                route = self.routes[label]
                return label, route, route.dialect, params
        return "unmatched", None, self._topics.get(_topic(parts), self.fallback), {}


def _match(template: tuple[str, ...], rest: bool, parts: tuple[str, ...]) -> dict[str, str] | None:
    if len(parts) != len(template) and not (rest and len(parts) > len(template)):
        return None
    params: dict[str, str] = {}
    for i, (want, got) in enumerate(zip(template, parts, strict=False)):
        if want.startswith("{"):
            if not got:
                return None
            params[want[1:-1]] = "/".join(parts[i:]) if rest and i == len(template) - 1 else got
        elif want != got:
            return None
    return params


def _silent(*_args: Any, **_fields: Any) -> None:
    """The record sink of routes whose refusals are not request-log records."""


def version_info() -> dict[str, str | int]:
    """What GET /version answers (torch's version read from its metadata: the event
    loop's side never imports torch)."""
    import importlib.metadata

    from ninfer import __version__
    from ninfer._requestlog import SCHEMA_VERSION

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - installed with us
        torch = "unknown"
    return {"version": __version__, "torch": torch, "request_log_schema": SCHEMA_VERSION}


class App:
    """One model, one engine, one scheduler; every request task in Hypercorn's nursery."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        model_path: str | None = None,
        argv: Sequence[str] | None = None,
        engine: EngineHost | None = None,
        binds_itself: bool = True,
    ) -> None:
        self.config = config
        self._openapi_body: bytes | None = None  # GET /openapi.json, built on first use
        self.lifespan = Lifespan(
            config, model_path=model_path, argv=argv, engine=engine, binds_itself=binds_itself
        )
        self._lives: set[Lifecycle] = set()  # requests being served, for force_stop
        # count_tokens takes no place in the scheduler (it never reaches the engine), so
        # it has a limit of its own: past it, 429 at once.
        self.counting = trio.CapacityLimiter(COUNT_TOKENS_CONCURRENCY)
        native, openai = NativeDialect(), OpenAIDialect()
        self.routes = RouteTable(native)
        own = {
            "/health": Route({"GET": self._health}, native, open=True, logged=False),
            # llama-server's name for it
            "/v1/health": Route({"GET": self._health}, native, open=True, logged=False),
            "/ready": Route({"GET": self._ready}, native, open=True, logged=False),
            "/metrics": Route({"GET": self._metrics}, native, open=config.metrics_public),
            "/version": Route({"GET": self._version}, native, logged=False),
            "/openapi.json": Route({"GET": self._openapi}, native, logged=False),
            "/props": Route({"GET": self._props}, native, logged=False),
            "/slots": Route({"GET": self._slots}, native, logged=False),
            # llama-server's resumable streams (api.md, "Resumable streams")
            "/v1/stream": Route(
                {"GET": self._stream_get, "DELETE": self._stream_delete}, openai, logged=False
            ),
            "/v1/streams/lookup": Route({"POST": self._streams_lookup}, openai, logged=False),
            # llama-server's built-in tools: not run here, answered as llama-server does
            # when started without them (its web UI then offers none)
            "/tools": Route({"GET": self._tools, "POST": self._tools}, openai, logged=False),
        }
        for path, route in own.items():
            self.routes.add(path, route)
        for cls in FRONTENDS:
            for declared in cls.routes():
                route = Route(self._handlers(cls, declared), cls.dialect)
                self.routes.add(
                    declared.path, route, rest=declared.rest, unversioned=cls.unversioned
                )

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)

    async def _lifespan(
        self, scope: LifespanScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        await self.lifespan.run(
            started=lambda: send({"type": "lifespan.startup.complete"}), stopping=receive
        )
        await send({"type": "lifespan.shutdown.complete"})

    def force_stop(self) -> None:
        """The last resort of a shutdown that clients hold up (a write stuck in the
        transport, which cancellation cannot reach): every request still undecided gets
        its record (request_cancelled, cause shutdown), then server_stop, and the log is
        closed. The caller then ends the process."""
        now = trio.current_time()
        for life in list(self._lives):
            if life.allows(Trigger.GONE):
                life.cut(now)
        self.lifespan.log.emit("server_stop", forced=True)
        self.lifespan.log.close()

    # ---- HTTP -----------------------------------------------------------------------------

    async def _http(
        self, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        request_id = request_id_from(scope)
        origin = cors_origin(self.config.cors, scope)
        if origin is not None:
            send = with_cors(send, origin)
        exchange = Exchange(receive, send)
        path, method = scope["path"], scope["method"]
        label, route, dialect, params = self.routes.resolve(path)
        emit = self.lifespan.log.emit if route is None or route.logged else _silent
        life = Lifecycle(request_id, label, trio.current_time(), emit)
        self._lives.add(life)
        try:
            if header(scope, b"content-length") is not None and header(scope, b"transfer-encoding"):
                # Two framings for one body: a request-smuggling attempt, or a broken
                # client. Refused, and the connection closed (RFC 9112, 6.3).
                raise ApiError(
                    "bad_request", "Content-Length and Transfer-Encoding must not both be sent"
                )
            if method == "OPTIONS" and self.config.cors is not None:
                await preflight(send, scope)
                return
            if route is None:
                raise ApiError("not_found", "no such endpoint")
            handler = route.methods.get(method)
            if handler is None and method == "HEAD":
                # HEAD is GET without the body (RFC 9110, 9.3.2): Hypercorn sends the
                # headers and drops the body (a load balancer's or uptime probe's HEAD).
                handler = route.methods.get("GET")
            if handler is None:
                allowed = tuple(
                    sorted(route.methods) + (["HEAD"] if "GET" in route.methods else [])
                )
                raise ApiError(
                    "method_not_allowed",
                    f"{method} is not allowed here; use {', '.join(allowed)}",
                    allow=allowed,
                )
            if not route.open:
                authorize(scope, self.config.api_key)
            await handler(scope, exchange, life, PathArgs(params, scope["query_string"]))
        except ApiError as err:  # refused before the request flow began: at the route
            if not life.decided:
                life.refused(
                    trio.current_time(),
                    status=dialect.status(err),
                    kind=err.kind,
                    code=err.code,
                    param=err.param,
                )
            if not exchange.status:
                await self._refuse(exchange, scope, dialect, err, request_id)
        except ClientGone:
            pass  # the connection broke while answering: the request's record is written
        except Exception:
            self.lifespan.diagnostics.exception("request_failed", request_id=request_id)
            internal = ApiError(
                "internal_error", "an unexpected error occurred; see the server log"
            )
            if not life.decided:
                life.failed(status=500, kind=internal.kind, message="unexpected error")
            if not exchange.status:
                await self._refuse(exchange, scope, dialect, internal, request_id)
        finally:
            self._lives.discard(life)
            if exchange.status:
                self.lifespan.metrics.http_done(label, exchange.status)
            if not self.config.no_access_log and (route is None or route.logged):
                self._access(method, label, exchange.status, life)

    def _access(self, method: str, label: str, status: int | None, life: Lifecycle) -> None:
        """The request's access line on the console (uvicorn's, llama-server's): method,
        route (its template, or `unmatched`: never the raw path), status (`-` where the
        client went before an answer began), `outcome=cancelled` and the stage it was in
        where the client (or the shutdown) ended it, tokens when it generated, seconds,
        request id. Probes (/health, /ready) are not shown."""
        fields: dict[str, Any] = {"method": method, "route": label, "status": status or "-"}
        if life.stage is Stage.CANCELLED:
            fields["outcome"] = "cancelled"
            fields["stage"] = life.left_at
        if life.tokens is not None:
            fields["tokens"] = f"{life.tokens[0]}+{life.tokens[1]}"
        fields["seconds"] = round(trio.current_time() - life.arrival, 3)
        self.lifespan.log.console("access", request_id=life.request_id, **fields)

    async def _websocket(
        self, scope: WebsocketScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """No route speaks WebSocket: the upgrade is refused as a plain HTTP answer (400,
        in the path's dialect) where the server allows it, else closed (403)."""
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        request_id = request_id_from(scope)
        label, _route, dialect, _params = self.routes.resolve(scope["path"])
        err = ApiError("bad_request", "WebSocket is not served here; streams use HTTP and SSE")
        status = dialect.status(err)
        life = Lifecycle(request_id, label, trio.current_time(), self.lifespan.log.emit)
        life.refused(trio.current_time(), status=status, kind=err.kind, code=None, param=None)
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1003, "reason": ""})
            return
        body = dialect.error_body(err, request_id)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (dialect.request_id_header, request_id.encode()),
        ]
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})

    async def _refuse(
        self, exchange: Exchange, scope: HTTPScope, dialect: Dialect, err: ApiError, rid: str
    ) -> None:
        limit = self.config.max_request_bytes
        with contextlib.suppress(ClientGone):  # gone: the request's record is written
            await send_refusal(exchange, scope, dialect, err, rid, max_request_bytes=limit)

    def _require_json(self, scope: HTTPScope) -> None:
        ctype = header(scope, b"content-type")
        if ctype is None or ctype.split(b";")[0].strip().lower() != b"application/json":
            raise ApiError("unsupported_media_type", "the request body must be application/json")

    async def _ok(self, exchange: Exchange, life: Lifecycle, body: bytes, **kw: Any) -> None:
        dialect = self.routes.routes[life.endpoint].dialect
        rid = [(dialect.request_id_header, life.request_id.encode())]
        await send_bytes(exchange.send, 200, body, rid, **kw)

    # ---- the frontends' routes ------------------------------------------------------------

    def _handlers(self, cls: type[Routed], declared: FrontendRoute) -> dict[str, Handler]:
        """What serves each method of a frontend's route: the frontend the lifespan built
        (or the readiness refusal), by the route's action."""

        def handler(method: str) -> Handler:
            action = declared.methods[method]

            async def serve(
                scope: HTTPScope, ex: Exchange, life: Lifecycle, args: PathArgs
            ) -> None:
                serving = self.lifespan.ready()
                frontend = serving.by_class[cls]
                if isinstance(action, Generate):
                    assert isinstance(frontend, Frontend)
                    self._require_json(scope)
                    await serve_generation(serving.flow, frontend, scope, ex, life)
                elif isinstance(action, Count):
                    count = action.answer
                    await self._counted(scope, ex, life, lambda body: count(frontend, body))
                else:
                    await self._ok(ex, life, action.answer(frontend, args))

            return serve

        return {method: handler(method) for method in declared.methods}

    async def _counted(
        self,
        scope: HTTPScope,
        exchange: Exchange,
        life: Lifecycle,
        count: Callable[[bytes], Awaitable[bytes]],
    ) -> None:
        """A token count: no place in the scheduler, a limit of its own (past it, 429)."""
        self._require_json(scope)
        try:
            self.counting.acquire_nowait()
        except trio.WouldBlock:
            raise ApiError(
                "server_overloaded",
                f"{COUNT_TOKENS_CONCURRENCY} token counts are being served; retry after the "
                "time in Retry-After",
                retry_after=1.0,
            ) from None
        try:
            deadline = trio.current_time() + self.config.read_timeout_s
            limit = self.config.max_request_bytes
            body = await read_body(scope, exchange.receive, limit, deadline)
            await self._ok(exchange, life, await count(body))
        finally:
            self.counting.release()

    # ---- the server's own routes ------------------------------------------------------------

    async def _health(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        """Liveness: 200 while the engine loads or runs; 503 once it has died (or failed
        to load), so that a supervisor restarts the process."""
        self.lifespan.alive()
        await self._ok(ex, life, b'{"status":"ok"}')

    async def _version(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        """ninfer's version (as vLLM's GET /version), with torch's and the request log's
        schema version."""
        await self._ok(ex, life, dumps(version_info()))

    async def _props(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        """llama.cpp's GET /props: the model, its context, template and capabilities."""
        await self._ok(ex, life, dumps(server_props(self.lifespan.ready().frontends)))

    async def _slots(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, a: PathArgs) -> None:
        """llama.cpp's GET /slots, read-only: one slot per place of --max-concurrency, the
        requests the engine runs (prefilling or decoding) in the first ones; with
        `fail_on_no_slot=1`, 429 with Retry-After when none is idle (ninfer's answer
        when it is full; llama-server's is 503)."""
        serving = self.lifespan.ready()
        running = sorted(
            (x for x in self._lives if x.stage in (Stage.PREFILL, Stage.DECODE)),
            key=lambda x: x.arrival,
        )
        slots = []
        for i in range(self.config.max_concurrency):
            busy = running[i] if i < len(running) else None
            slot: dict[str, Any] = {
                "id": i,
                "n_ctx": serving.model.max_context,
                "speculative": serving.model.speculative != "none",
                "is_processing": busy is not None,
            }
            if busy is not None:
                slot.update(request_id=busy.request_id, endpoint=busy.endpoint)
                slot["stage"] = busy.stage.value
            slots.append(slot)
        if b"fail_on_no_slot=1" in a.query and len(running) >= self.config.max_concurrency:
            raise ApiError("server_overloaded", "no slot is idle", retry_after=1.0)
        await self._ok(ex, life, dumps(slots))

    def _streams(self) -> StreamSessions:
        streams = self.lifespan.ready().flow.streams
        if streams is None or not streams.enabled:
            raise ApiError(
                "not_found", "resumable streams are off on this server (--stream-resume-s 0)"
            )
        return streams

    async def _stream_get(
        self, scope: HTTPScope, ex: Exchange, life: Lifecycle, a: PathArgs
    ) -> None:
        """llama-server's GET /v1/stream?conv_id=…&from=N: a resumable stream's bytes from
        offset N (0 by default), then its live ones to its end."""
        streams = self._streams()
        query = _query(a.query)
        conv = query.get("conv_id", "")
        if not conv:
            raise ApiError("invalid_request", "conv_id is required", param="conv_id")
        session = streams.get(conv)
        if session is None:
            raise ApiError(
                "not_found", "no stream for this conversation: never begun, stopped or expired"
            )
        raw = query.get("from", "0") or "0"
        offset = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 18 else -1
        if offset < 0 or offset > session.total_bytes:
            raise ApiError(
                "invalid_request",
                f"from must be a byte offset within the stream's {session.total_bytes} bytes",
                param="from",
            )
        if offset < session.dropped:
            raise ApiError(
                "invalid_request",
                "the stream no longer keeps the bytes from that offset; start again",
                param="from",
            )
        await serve_replay(
            self.lifespan.ready().flow, ex, session, offset, life.request_id.encode()
        )

    async def _stream_delete(
        self, scope: HTTPScope, ex: Exchange, life: Lifecycle, a: PathArgs
    ) -> None:
        """llama-server's DELETE /v1/stream?conv_id=…: stop that conversation's generation
        and drop its stream (204, also where there was none)."""
        streams = self._streams()
        conv = _query(a.query).get("conv_id", "")
        if not conv:
            raise ApiError("invalid_request", "conv_id is required", param="conv_id")
        streams.delete(conv)
        rid = [(b"x-request-id", life.request_id.encode())]
        await send_bytes(ex.send, 204, b"", rid)

    async def _streams_lookup(
        self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs
    ) -> None:
        """llama-server's POST /v1/streams/lookup {"conversation_ids": [...]}: the streams
        of the named conversations (never others': nobody can list them)."""
        streams = self._streams()
        self._require_json(scope)
        deadline = trio.current_time() + self.config.read_timeout_s
        body = await read_body(scope, ex.receive, self.config.max_request_bytes, deadline)
        parsed = loads(body)
        ids = parsed.get("conversation_ids", []) if isinstance(parsed, dict) else None
        if (
            not isinstance(ids, list)
            or len(ids) > LOOKUP_IDS_MAX
            or not all(isinstance(i, str) for i in ids)
        ):
            raise ApiError(
                "invalid_request",
                f"conversation_ids must be an array of at most {LOOKUP_IDS_MAX} strings",
                param="conversation_ids",
            )
        await self._ok(ex, life, dumps(streams.lookup([i for i in ids if i])))

    async def _tools(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        raise ApiError(
            "feature_disabled",
            "this server runs no built-in tools; send tools with the request instead",
        )

    async def _openapi(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        """The contract this server keeps (what `ninfer openapi` writes, and
        docs/openapi.json ships), built once."""
        if self._openapi_body is None:
            from ninfer import __version__
            from protocols import openapi_document

            self._openapi_body = await trio.to_thread.run_sync(
                lambda: dumps(openapi_document(__version__))
            )
        await self._ok(ex, life, self._openapi_body)

    async def _ready(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        model = self.lifespan.ready().model
        summary = {"id": self.lifespan.public_id, "architecture": model.identity.architecture}
        summary["sha256"] = model.identity.sha256
        log = self.lifespan.log_health()
        # The fast paths the self-check refused at start-up, and what runs instead.
        refused = [{"path": r.path, "instead": r.instead} for r in model.self_check if not r.ok]
        body = {"status": "ready", "model": summary, "request_log": log, "self_check": {
            "passed": [r.path for r in model.self_check if r.ok], "refused": refused
        }}  # fmt: skip
        await self._ok(ex, life, dumps(body))

    async def _metrics(self, scope: HTTPScope, ex: Exchange, life: Lifecycle, _: PathArgs) -> None:
        """Prometheus text format; served while loading too (levels read as zero)."""
        body = self.lifespan.metrics.render()
        await self._ok(ex, life, body, content_type=METRICS_CONTENT_TYPE)


def _query(raw: bytes) -> dict[str, str]:
    """A query string's parameters (the first of each name), percent-decoded."""
    from urllib.parse import parse_qsl

    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    out: dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def create_app(config: ServerConfig | None = None, **kwargs: Any) -> App:
    """The ASGI app. Without a config, settings come from NINFER_* variables and the TOML
    file named by NINFER_CONFIG (read once, here)."""
    if config is None:
        try:
            config = config_from_env(os.environ)
        except ConfigError as exc:  # one line, and a failing exit (not a traceback)
            print(f"ninfer: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    # Hypercorn's --bind decides where this listens, not NINFER_HOST / NINFER_PORT: the
    # log says so rather than repeat settings that do not apply.
    kwargs.setdefault("binds_itself", False)
    try:  # Hypercorn runs this app: its two wrappers (ninfer/_hypercorn.py)
        adapt_hypercorn()
    except ConfigError as exc:
        print(f"ninfer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return App(config, **kwargs)
