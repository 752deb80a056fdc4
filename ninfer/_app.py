"""The ASGI application: the lifespan (engine, scheduler, throughput log) and the route
table. Generation routes hand their frontend to the request flow (`ninfer._flow`).

`create_app()` is the factory Hypercorn's trio worker calls
(`hypercorn --worker-class trio 'ninfer.app:create_app()'`); `ninfer serve` builds
the same app from flags and serves it with `hypercorn.trio.serve`.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import re
import sys
import time
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

from ninfer._artifacts import REGISTRY, cache_dir, resolve_model
from ninfer._bridge import EngineHost, EngineService, ThreadedEngine
from ninfer._config import ServerConfig, config_from_env, public_settings, redacted_argv
from ninfer._errors import ConfigError
from ninfer._estimate import ServiceTimes
from ninfer._flow import FlowContext, serve_generation
from ninfer._http import (
    ClientGone,
    Exchange,
    cors_origin,
    header,
    preflight,
    read_body,
    request_id_from,
    send_bytes,
    send_refusal,
    with_cors,
)
from ninfer._lifecycle import Lifecycle, Trigger
from ninfer._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ninfer._metrics import Metrics
from ninfer._requestlog import RequestLog
from ninfer.engine import EngineConfig, ServedModel
from ninfer.frontends import (
    ChatFrontend,
    CompletionsFrontend,
    Frontend,
    FrontendContext,
    MessagesFrontend,
    NativeFrontend,
    model_card,
    model_list,
)
from protocols import AnthropicDialect, ApiError, Dialect, NativeDialect, OpenAIDialect, dumps
from scheduler import AdmissionController

__all__ = ["App", "create_app"]

# Filesystem paths in an error message (replaced before it leaves the process).
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s\\/:'\"]+){2,}[\\/]?")

# Token counts served at once (/v1/messages/count_tokens).
COUNT_TOKENS_CONCURRENCY = 2

# Prompts longer than this many characters are tokenized on a worker thread.
_INLINE_TOKENIZE_CHARS = 4096

Handler = Callable[[HTTPScope, Exchange, Lifecycle], Awaitable[None]]


@attrs.frozen
class Route:
    """One path: its handlers by method, the dialect its refusals speak, whether it
    needs the API key, and whether its refusals are request-log records."""

    methods: Mapping[str, Handler]
    dialect: Dialect
    open: bool = False  # served without the API key (/health, /ready)
    logged: bool = True


@attrs.define
class _Serving:
    """What exists once the model is loaded."""

    model: ServedModel
    scheduler: AdmissionController
    flow: FlowContext
    frontends: FrontendContext
    by_path: dict[str, Frontend]
    messages: MessagesFrontend


# Clients given a base URL without `/v1` post to these; they are the /v1 routes.
_UNVERSIONED = ("/chat/", "/completions", "/models", "/messages")


def _versioned(path: str) -> str:
    """The /v1 route a path without `/v1` is an alias of (others unchanged)."""
    return "/v1" + path if path.startswith(_UNVERSIONED) else path


def _silent(*_args: Any, **_fields: Any) -> None:
    """The record sink of routes whose refusals are not request-log records."""


class App:
    """One model, one engine, one scheduler; every request task in Hypercorn's nursery."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        model_path: str | None = None,
        argv: Sequence[str] | None = None,
        engine: EngineHost | None = None,
    ) -> None:
        self.config = config
        self.log = RequestLog(config.request_log_jsonl)
        self.diagnostics = self.log.diagnostics()
        self._argv = redacted_argv(list(argv if argv is not None else sys.argv), config.api_key)
        self._model_path = model_path
        if engine is None:
            engine = ThreadedEngine(
                self._resolve_model,
                EngineConfig(
                    max_batch=config.max_concurrency,
                    kv_capacity=config.kv_capacity or config.max_context or 8192,
                    page_size=16,
                    prefill_chunk=config.prefill_chunk,
                    max_context=config.max_context,
                    dtype=config.dtype,
                    weights=config.weights,
                    device=config.device,
                ),
                threads=config.threads,
                log=self.diagnostics,
                progress=self._progress,
            )
        self.service = EngineService(engine, log=self.diagnostics)
        self.serving: _Serving | None = None
        self.metrics = Metrics(
            lambda: self.serving.scheduler.statistics() if self.serving else None,
            self.service.statistics,
            lambda: (self.log.failure is not None, self.log.dropped),
        )
        self.log.subscribe(self.metrics.on_event)
        names = config.served_model_name
        self.public_id = names[0] if names else ""
        self.served_names: tuple[str, ...] = names or ()
        self._draining = False
        self._lives: set[Lifecycle] = set()  # requests being served, for force_stop
        self._started_at: float | None = None  # Trio time the lifespan began loading
        self._drain_started_at: float | None = None
        self.settled = trio.Event()  # set once the model is loaded and admitting, or failed
        self._background = trio.CancelScope()  # the periodic tasks, cancelled at shutdown
        self._tokenize_limiter = trio.CapacityLimiter(2)
        # count_tokens takes no place in the scheduler (it never reaches the engine), so
        # it has a limit of its own: past it, 429 at once.
        self.counting = trio.CapacityLimiter(COUNT_TOKENS_CONCURRENCY)
        self._created = int(time.time())
        native, openai, anthropic = NativeDialect(), OpenAIDialect(), AnthropicDialect()
        self._dialects = {"native": native, "openai": openai, "anthropic": anthropic}
        self._routes: dict[str, Route] = {
            "/health": Route({"GET": self._health}, native, open=True, logged=False),
            "/ready": Route({"GET": self._ready}, native, open=True, logged=False),
            "/metrics": Route({"GET": self._metrics}, native),
            "/v1/generate": Route({"POST": self._generate}, native),
            "/v1/models": Route({"GET": self._models}, openai),
            "/v1/models/{model}": Route({"GET": self._model_one}, openai),
            "/v1/chat/completions": Route({"POST": self._generate}, openai),
            "/v1/completions": Route({"POST": self._generate}, openai),
            "/v1/messages": Route({"POST": self._generate}, anthropic),
            "/v1/messages/count_tokens": Route({"POST": self._count_tokens}, anthropic),
        }

    @property
    def model(self) -> ServedModel | None:
        return self.serving.model if self.serving else None

    @property
    def scheduler(self) -> AdmissionController | None:
        return self.serving.scheduler if self.serving else None

    def _resolve_model(self) -> str:
        """The model file (fetched on first use); called on the engine thread."""
        if self._model_path is not None:
            return self._model_path
        cfg = self.config
        where = cache_dir(cfg.cache_dir, os.environ)
        return str(resolve_model(cfg.model, where, progress=self._progress))

    def _progress(self, message: str) -> None:
        self.log.console(message)

    # ---- lifespan -------------------------------------------------------------------------

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
        self._started_at = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.service.run)
                nursery.start_soon(self._after_load, nursery)
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
                # Hypercorn has finished (or cancelled) every request by now.
                self.begin_drain()
                self._background.cancel()
                self.service.shutdown()  # the engine loop returns; service.run ends
        finally:
            self.log.emit("server_stop")
            self.log.close()
        await send({"type": "lifespan.shutdown.complete"})

    async def _after_load(self, nursery: trio.Nursery) -> None:
        await self.service.wait_loaded()
        model = self.service.model
        if model is None:
            state = self.service.state()  # the console has had engine_died, with the cause
            self.log.emit("server_error", error=state.error)
            self.settled.set()
            return
        # --served-model-name's first, else the registered name the model was asked for
        # by, else the file's id.
        registered = self.config.model if self.config.model in REGISTRY else None
        names = self.config.served_model_name
        self.public_id = names[0] if names else registered or model.identity.model_id
        # The names a request may give: the served names, else the public id and the
        # file's own id.
        self.served_names = names or tuple(dict.fromkeys([self.public_id, model.identity.model_id]))
        self.serving = self._build_serving(model)
        ident = model.identity
        self.log.emit(
            "server_start",
            config=public_settings(self.config),
            argv=self._argv,
            model={
                "id": self.public_id,
                "model_id": ident.model_id,
                "architecture": ident.architecture,
                "sha256": ident.sha256,
                "context_length": ident.context_length,
                "vocab_size": ident.vocab_size,
                "path": ident.path,
                "load_seconds": model.load_seconds,
            },
            engine={
                "max_context": model.max_context,
                "kv_pages": model.kv_pages,
                "page_size": model.page_size,
                "dtype": model.dtype,
                "device": model.device,
                "batch_invariant": model.batch_invariant,
                "batch_sizes": list(model.batch_sizes),
            },
        )
        self.log.console(
            "ready",
            model=self.public_id,
            sha256=ident.sha256[:12],
            load_s=round(model.load_seconds, 2),
        )
        self.settled.set()
        if self.config.log_stats_interval_ms > 0:
            nursery.start_soon(self._throughput_loop)

    def _build_serving(self, model: ServedModel) -> _Serving:
        """The scheduler, the frontends and the request flow, built once."""
        cfg = self.config
        service_times = ServiceTimes(self.service.statistics, cfg.default_max_tokens)
        scheduler = AdmissionController(
            max_running=cfg.max_concurrency,
            max_pending=cfg.max_pending_requests,
            units_total=model.kv_pages,
            service_time=service_times,
        )
        ctx = FrontendContext(
            model=model,
            config=cfg,
            public_id=self.public_id,
            names=self.served_names,
            tokenize=self._tokenize,
            created=self._created,
        )
        messages = MessagesFrontend(ctx)
        frontends: list[Frontend] = [
            NativeFrontend(ctx),
            ChatFrontend(ctx),
            CompletionsFrontend(ctx),
            messages,
        ]
        flow = FlowContext(
            scheduler=scheduler,
            engine=self.service,
            log=self.log,
            max_request_bytes=cfg.max_request_bytes,
            read_timeout_s=cfg.read_timeout_s,
            write_timeout_s=cfg.write_timeout_s,
            pending_timeout_s=cfg.pending_timeout_ms / 1000.0,
            pages_needed=model.pages_needed,
            draining=lambda: self.shutting_down() if self._draining else None,
            service_times=service_times,
            on_tokens=self.metrics.inter_token,
        )
        return _Serving(
            model=model,
            scheduler=scheduler,
            flow=flow,
            frontends=ctx,
            by_path={f.endpoint: f for f in frontends},
            messages=messages,
        )

    async def _throughput_loop(self) -> None:
        with self._background:
            await self._report_throughput()

    async def _report_throughput(self) -> None:
        interval = self.config.log_stats_interval_ms / 1000.0
        prev = self.service.statistics()
        while True:
            await trio.sleep(interval)
            cur = self.service.statistics()
            if cur is None or prev is None:
                prev = cur
                continue
            steps = cur.decode_steps - prev.decode_steps
            generated = cur.generated_tokens - prev.generated_tokens
            prefill = cur.prefill_tokens - prev.prefill_tokens
            sched = self.serving.scheduler.statistics() if self.serving else None
            if steps == 0 and prefill == 0 and not cur.busy:
                prev = cur
                continue  # idle interval: skipped
            rows = cur.decode_rows - prev.decode_rows
            self.log.emit(
                "throughput",
                interval_seconds=interval,
                generated_tokens=generated,
                prefill_tokens=prefill,
                decode_steps=steps,
                generated_tokens_per_second=generated / interval,
                prefill_tokens_per_second=prefill / interval,
                avg_decode_batch=rows / steps if steps else 0.0,
                running=cur.decoding + cur.prefilling,
                waiting=sched.waiting if sched else 0,
                kv_pages_used=cur.pages_used,
                kv_pages_free=cur.pages_free,
            )
            prev = cur

    def shutting_down(self) -> ApiError:
        """The refusal while draining; Retry-After is what remains of the drain (after
        which this process is gone, and a supervisor may have started another)."""
        began = self._drain_started_at if self._drain_started_at is not None else 0.0
        left = max(1.0, self.config.graceful_timeout_s - (trio.current_time() - began))
        return ApiError("shutting_down", "the server is shutting down", retry_after=left)

    def force_stop(self) -> None:
        """The last resort of a shutdown that clients hold up (a write stuck in the
        transport, which cancellation cannot reach): every request still undecided gets
        its record (request_cancelled, cause shutdown), then server_stop, and the log is
        closed. The caller then ends the process."""
        now = trio.current_time()
        for life in list(self._lives):
            if life.allows(Trigger.GONE):
                life.cut(now)
        self.log.emit("server_stop", forced=True)
        self.log.close()

    def begin_drain(self) -> None:
        """Stop admitting: new generation requests get 503 shutting_down."""
        if not self._draining:
            self._draining = True
            self._drain_started_at = trio.current_time()
            self.log.console("draining: new requests are refused, in-flight ones finish")

    # ---- HTTP -----------------------------------------------------------------------------

    def _route_label(self, path: str) -> str:
        """The route template, for metric labels and log records: raw paths are unbounded.
        A path without `/v1` is labelled as the route it is an alias of."""
        path = _versioned(path)
        if path in self._routes:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return "unmatched"

    def _resolve(self, path: str) -> tuple[str, Route | None, Dialect]:
        """The path's route template, its route (None: no such route) and the dialect
        its refusals speak (the route's, else the protocol its prefix belongs to)."""
        label = self._route_label(path)
        route = self._routes.get(label)
        return label, route, route.dialect if route else self._dialect_for(path)

    def _dialect_for(self, path: str) -> Dialect:
        """The dialect of an unmatched path: the protocol its prefix belongs to."""
        path = _versioned(path)
        if path.startswith(("/v1/chat/", "/v1/completions", "/v1/models")):
            return self._dialects["openai"]
        if path.startswith("/v1/messages"):
            return self._dialects["anthropic"]
        return self._dialects["native"]

    async def _http(
        self, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        request_id = request_id_from(scope)
        origin = cors_origin(self.config.cors, scope)
        if origin is not None:
            send = with_cors(send, origin)
        exchange = Exchange(receive, send)
        path, method = scope["path"], scope["method"]
        label, route, dialect = self._resolve(path)
        emit = self.log.emit if route is None or route.logged else _silent
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
            if handler is None:
                allowed = tuple(sorted(route.methods))
                raise ApiError(
                    "method_not_allowed",
                    f"{method} is not allowed here; use {', '.join(allowed)}",
                    allow=allowed,
                )
            if not route.open:
                self._authorize(scope)
            await handler(scope, exchange, life)
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
            self.diagnostics.exception("request_failed", request_id=request_id)
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
                self.metrics.http_done(label, exchange.status)

    async def _websocket(
        self, scope: WebsocketScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """No route speaks WebSocket: the upgrade is refused as a plain HTTP answer (400,
        in the path's dialect) where the server allows it, else closed (403)."""
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        request_id = request_id_from(scope)
        label, _route, dialect = self._resolve(scope["path"])
        err = ApiError("bad_request", "WebSocket is not served here; streams use HTTP and SSE")
        status = dialect.status(err)
        life = Lifecycle(request_id, label, trio.current_time(), self.log.emit)
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

    def _authorize(self, scope: HTTPScope) -> None:
        key = self.config.api_key
        if key is None:
            return
        presented = header(scope, b"x-api-key")
        auth = header(scope, b"authorization")
        if presented is None and auth is not None and auth[:7].lower() == b"bearer ":
            presented = auth[7:].strip()
        if presented is None or not hmac.compare_digest(presented, key.encode()):
            raise ApiError(
                "unauthorized", "a valid API key is required (Authorization: Bearer or x-api-key)"
            )

    def _serving(self) -> _Serving:
        """What a model route needs, or the readiness refusal (503 with Retry-After)."""
        err = self._readiness_error()
        if err is not None:
            raise err
        assert self.serving is not None
        return self.serving

    def _readiness_error(self) -> ApiError | None:
        if self._draining:
            return self.shutting_down()
        state = self.service.state()
        if state.phase == "loading" or (state.phase == "ready" and self.serving is None):
            # As long again as it has taken so far: loading time is not known in advance.
            began = self._started_at if self._started_at is not None else trio.current_time()
            loading_for = max(1.0, trio.current_time() - began)
            return ApiError("model_loading", "the model is still loading", retry_after=loading_for)
        if state.phase != "ready":
            return self._engine_down(state.error)
        if state.stalled:
            return ApiError(
                "engine_unavailable", "the engine has stopped making progress", retry_after=5
            )
        return None

    def _engine_down(self, error: str | None) -> ApiError:
        """The engine has stopped: say why (paths redacted: none leaves the process)."""
        why = f": {_PATH.sub('<path>', error)}" if error else ""
        return ApiError("engine_unavailable", f"the engine is not running{why}", retry_after=5)

    def _require_json(self, scope: HTTPScope) -> None:
        ctype = header(scope, b"content-type")
        if ctype is None or ctype.split(b";")[0].strip().lower() != b"application/json":
            raise ApiError("unsupported_media_type", "the request body must be application/json")

    async def _ok(self, exchange: Exchange, life: Lifecycle, body: bytes, **kw: Any) -> None:
        dialect = self._routes[life.endpoint].dialect
        rid = [(dialect.request_id_header, life.request_id.encode())]
        await send_bytes(exchange.send, 200, body, rid, **kw)

    async def _tokenize(self, text: str) -> list[int]:
        assert self.serving is not None
        tok = self.serving.model.tokenizer
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tok.encode(text)
        return await trio.to_thread.run_sync(tok.encode, text, limiter=self._tokenize_limiter)

    # ---- handlers ---------------------------------------------------------------------------

    async def _health(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        """Liveness: 200 while the engine loads or runs; 503 once it has died (or failed
        to load), so that a supervisor restarts the process."""
        state = self.service.state()
        if state.phase == "failed":
            raise self._engine_down(state.error)
        await self._ok(exchange, life, b'{"status":"ok"}')

    async def _ready(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        model = self._serving().model
        summary = {"id": self.public_id, "architecture": model.identity.architecture}
        summary["sha256"] = model.identity.sha256
        # Ready all the same when the request log has failed (serving goes on; it is an
        # operator's matter): said here, and on /metrics, and once on the console.
        log: dict[str, Any] = {"ok": self.log.failure is None, "dropped": self.log.dropped}
        if self.log.failure is not None:
            log["error"] = _PATH.sub("<path>", self.log.failure)
        body = {"status": "ready", "model": summary, "request_log": log}
        await self._ok(exchange, life, dumps(body))

    async def _metrics(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        """Prometheus text format; served while loading too (levels read as zero)."""
        body = self.metrics.render()
        await self._ok(exchange, life, body, content_type=METRICS_CONTENT_TYPE)

    async def _models(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        ctx = self._serving().frontends
        await self._ok(exchange, life, self._dialects["openai"].encoder.json(model_list(ctx)))

    async def _model_one(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        ctx = self._serving().frontends
        name = ctx.check_model(_versioned(scope["path"]).removeprefix("/v1/models/"))
        await self._ok(exchange, life, self._dialects["openai"].encoder.json(model_card(ctx, name)))

    async def _generate(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        serving = self._serving()
        self._require_json(scope)
        frontend = serving.by_path[life.endpoint]
        await serve_generation(serving.flow, frontend, scope, exchange, life)

    async def _count_tokens(self, scope: HTTPScope, exchange: Exchange, life: Lifecycle) -> None:
        """Counts with the same template as /v1/messages, without generating (and without
        taking a place in the scheduler: it never reaches the engine)."""
        serving = self._serving()
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
            await self._ok(exchange, life, await serving.messages.count_tokens(body))
        finally:
            self.counting.release()


def create_app(config: ServerConfig | None = None, **kwargs: Any) -> App:
    """The ASGI app. Without a config, settings come from NINFER_* variables and the TOML
    file named by NINFER_CONFIG (read once, here)."""
    if config is None:
        try:
            config = config_from_env(os.environ)
        except ConfigError as exc:  # one line, and a failing exit (not a traceback)
            print(f"ninfer: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    return App(config, **kwargs)
