"""The ASGI application: lifespan (engine, scheduler, throughput log) and routing.

`create_app()` is the factory Hypercorn's trio worker calls
(`hypercorn --worker-class trio 'ninfer.app:create_app()'`); `ninfer serve` builds
the same app from flags and serves it with `hypercorn.trio.serve`.
"""

from __future__ import annotations

import hmac
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPScope,
    LifespanScope,
    Scope,
)

from ninfer._anthropic_api import AnthropicResponder, messages_preparer, render_conversation
from ninfer._artifacts import REGISTRY, cache_dir, resolve_model
from ninfer._budget import Limits
from ninfer._config import ServerConfig, config_from_env, public_settings, redacted_argv
from ninfer._engine import DTYPES, Engine, EngineConfig
from ninfer._errors import RequestInvalid
from ninfer._generation import (
    DISCARD_BODY_S,
    GenerationContext,
    error_headers,
    run_generation,
)
from ninfer._http import (
    ClientGone,
    Exchange,
    discard_body,
    error_for,
    header,
    preflight,
    read_body,
    request_id_from,
    rid_header,
    send_bytes,
    with_cors,
    worth_draining,
)
from ninfer._loader import LoadedModel, load_model
from ninfer._messages import GenerationRequest
from ninfer._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ninfer._metrics import Metrics
from ninfer._native_api import NativeResponder, native_preparer
from ninfer._openai_api import (
    OpenAIResponder,
    chat_preparer,
    completion_preparer,
    model_card,
)
from ninfer._requestlog import RequestLog
from ninfer._service import EngineService
from protocols import (
    AnthropicCodec,
    ApiError,
    NativeCodec,
    OpenAICodec,
    dumps,
    loads,
)
from scheduler import AdmissionController

__all__ = ["App", "create_app"]

_log = logging.getLogger("ninfer.app")

# Prompts longer than this many characters are tokenized on a worker thread.
_INLINE_TOKENIZE_CHARS = 4096

Handler = Callable[[HTTPScope, ASGIReceiveCallable, ASGISendCallable, str], Awaitable[None]]


class App:
    """One model, one engine thread, one scheduler; every request task in Hypercorn's nursery."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        model_path: str | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        self.log = RequestLog(config.request_log_jsonl)
        self._argv = redacted_argv(list(argv if argv is not None else sys.argv))
        self._model_path = model_path
        self.service = EngineService(
            self._load,
            EngineConfig(
                max_batch=config.max_concurrency,
                kv_capacity=config.kv_capacity or config.max_context or 8192,
                page_size=16,
                prefill_chunk=config.prefill_chunk,
                max_context=config.max_context,
                dtype=config.dtype,
                weights=config.weights,
                device=config.device,
                threads=config.threads,
            ),
        )
        self.scheduler: AdmissionController | None = None
        self.metrics = Metrics(
            lambda: self.scheduler.statistics() if self.scheduler else None,
            self.service.statistics,
        )
        self.log.subscribe(self.metrics.on_event)
        self._context: GenerationContext | None = None
        self._request_limits: Limits | None = None
        self.model: LoadedModel | None = None
        self.public_id = config.model_id or ""
        self._draining = False
        self.load_failed = trio.Event()  # set when the model cannot be loaded
        self.settled = trio.Event()  # set once the model is loaded and admitting, or failed
        self._background = trio.CancelScope()  # the periodic tasks, cancelled at shutdown
        self._codec = NativeCodec()
        self._tokenize_limiter = trio.CapacityLimiter(2)
        self._routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self._health},
            "/ready": {"GET": self._ready},
            "/v1/generate": {"POST": self._generate},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/v1/messages": {"POST": self._messages},
            "/v1/messages/count_tokens": {"POST": self._count_tokens},
            "/metrics": {"GET": self._metrics},
        }
        self._anthropic = AnthropicCodec()
        self._openai = OpenAICodec()
        self._created = int(time.time())

    # ---- model loading (on the engine thread) -------------------------------------------

    def _load(self) -> LoadedModel:
        cfg = self.config
        path = self._model_path or str(
            resolve_model(cfg.model, cache_dir(cfg.cache_dir, os.environ), progress=self._progress)
        )
        import torch

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        return load_model(
            path,
            dtype=DTYPES[cfg.dtype],
            device=cfg.device,
            max_positions=cfg.max_context or 1 << 20,
            weights=cfg.weights,
            progress=self._progress,
        )

    def _progress(self, message: str) -> None:
        self.log.console(message)

    # ---- lifespan -------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)

    async def _lifespan(
        self, scope: LifespanScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
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
        engine = self.service.engine
        if model is None or engine is None:
            state = self.service.state()
            self.log.console("the model failed to load", error=state.error)
            self.log.emit("server_error", error=state.error)
            self.load_failed.set()
            self.settled.set()
            return
        self.model = model
        # --model-id, else the registered name the model was asked for by, else the file's id.
        registered = self.config.model if self.config.model in REGISTRY else None
        self.public_id = self.config.model_id or registered or model.identity.model_id
        self.scheduler = AdmissionController(
            max_running=self.config.max_concurrency,
            max_pending=self.config.max_pending_requests,
            units_total=engine.page_count,
        )
        self._build_serving(engine, self.scheduler)
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
                "max_context": engine.max_context,
                "kv_pages": engine.page_count,
                "page_size": engine.config.page_size,
                "dtype": engine.config.dtype,
                "device": engine.config.device,
                "batch_invariant": engine.batch_invariant,
                "batch_sizes": list(engine.statistics().batch_sizes),
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
            sched = self.scheduler.statistics() if self.scheduler else None
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

    def begin_drain(self) -> None:
        """Stop admitting: new generation requests get 503 shutting_down."""
        if not self._draining:
            self._draining = True
            self.log.console("draining: new requests are refused, in-flight ones finish")

    # ---- HTTP -----------------------------------------------------------------------------

    async def _http(
        self, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        request_id = request_id_from(scope)
        if self.config.cors:
            send = with_cors(send)
        exchange = Exchange(receive, send)
        try:
            await self._route(scope, exchange, request_id)
        except ClientGone:
            pass  # the connection broke while answering: the request's record is written
        finally:
            if exchange.status:
                self.metrics.http_done(self._route_label(scope["path"]), exchange.status)

    def _route_label(self, path: str) -> str:
        """The route template for metric labels: raw paths would be unbounded."""
        if path in self._routes:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return "unmatched"

    async def _route(self, scope: HTTPScope, exchange: Exchange, request_id: str) -> None:
        path, method = scope["path"], scope["method"]
        receive, send = exchange.raw_receive, exchange.send
        try:
            if method == "OPTIONS" and self.config.cors:
                await preflight(send)
                return
            route = self._routes.get(path)
            if route is None and path.startswith("/v1/models/"):
                route = {"GET": self._model_one}
            if route is None:
                raise ApiError("not_found", "no such endpoint")
            handler = route.get(method)
            if handler is None:
                raise ApiError(
                    "method_not_allowed",
                    f"{method} is not allowed here; use {', '.join(sorted(route))}",
                    allow=tuple(sorted(route)),
                )
            if path not in ("/health", "/ready"):
                self._authorize(scope)
            await handler(scope, exchange.receive, exchange.send, request_id)
        except ApiError as err:
            if not exchange.status:
                status, body = error_for(path, err, request_id)
                if path not in ("/health", "/ready"):
                    self.log.emit(
                        "request_rejected",
                        request_id,
                        endpoint=path,
                        status=status,
                        type=err.kind,
                        code=err.code,
                        param=err.param,
                        phase="route",
                    )
                if not exchange.body_done and worth_draining(scope, err.kind):
                    await discard_body(receive, self.config.max_request_bytes, DISCARD_BODY_S)
                await send_bytes(
                    send, status, body, error_headers(err, rid_header(path), request_id)
                )
        except ClientGone:
            return  # gone before anything was prepared: nothing to answer or log
        except Exception:
            _log.exception("request %s failed", request_id)
            self.log.emit(
                "request_error", request_id, endpoint=path, status=500, type="internal_error"
            )
            if not exchange.status:
                internal = ApiError(
                    "internal_error", "an unexpected error occurred; see the server log"
                )
                status, body = error_for(path, internal, request_id)
                await send_bytes(
                    send, status, body, error_headers(internal, rid_header(path), request_id)
                )

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

    def _check_ready(self) -> None:
        """Raise the readiness error (503 with Retry-After) when not serving."""
        err = self._readiness_error()
        if err is not None:
            raise err

    def _readiness_error(self) -> ApiError | None:
        if self._draining:
            return ApiError("shutting_down", "the server is shutting down", retry_after=1)
        state = self.service.state()
        if state.phase == "loading" or (state.phase == "ready" and self.scheduler is None):
            return ApiError("model_loading", "the model is still loading", retry_after=2)
        if state.phase != "ready":
            return ApiError("engine_unavailable", "the engine is not running", retry_after=5)
        if state.stalled:
            return ApiError(
                "engine_unavailable", "the engine has stopped making progress", retry_after=5
            )
        return None

    async def _health(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        await send_bytes(send, 200, b'{"status":"ok"}', [(b"x-request-id", request_id.encode())])

    async def _metrics(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        """Prometheus text format; served while loading too (levels read as zero)."""
        body = self.metrics.render()
        await send_bytes(
            send,
            200,
            body,
            [(b"x-request-id", request_id.encode())],
            content_type=METRICS_CONTENT_TYPE,
        )

    async def _ready(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        self._check_ready()
        body = dumps({"status": "ready", "model": self._model_summary()})
        await send_bytes(send, 200, body, [(b"x-request-id", request_id.encode())])

    def _model_summary(self) -> dict[str, Any]:
        assert self.model is not None
        ident = self.model.identity
        return {"id": self.public_id, "architecture": ident.architecture, "sha256": ident.sha256}

    async def _tokenize(self, text: str) -> list[int]:
        assert self.model is not None
        tok = self.model.tokenizer
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tok.encode(text)
        return await trio.to_thread.run_sync(tok.encode, text, limiter=self._tokenize_limiter)

    def _build_serving(self, engine: Engine, scheduler: AdmissionController) -> None:
        """What every generation request needs, fixed once the model is loaded."""
        self._context = GenerationContext(
            scheduler=scheduler,
            service=self.service,
            log=self.log,
            max_request_bytes=self.config.max_request_bytes,
            read_timeout_s=self.config.read_timeout_s,
            write_timeout_s=self.config.write_timeout_s,
            pending_timeout_s=self.config.pending_timeout_ms / 1000.0,
            pages_needed=engine.pages_needed,
            is_draining=lambda: self._draining,
            on_tokens=self.metrics.inter_token,
        )
        self._request_limits = Limits(
            max_context=engine.max_context,
            default_max_tokens=self.config.default_max_tokens,
            pages_total=engine.page_count,
            pages_needed=engine.pages_needed,
        )

    def _generation_context(self) -> GenerationContext:
        assert self._context is not None, "only called once ready"
        return self._context

    def _limits(self) -> Limits:
        assert self._request_limits is not None, "only called once ready"
        return self._request_limits

    def _engine_check(self, request: GenerationRequest) -> None:
        engine = self.service.engine
        assert engine is not None
        try:
            engine.check(request)
        except RequestInvalid as exc:
            raise ApiError("invalid_request", str(exc), param=exc.param) from None

    def _require_json(self, scope: HTTPScope) -> None:
        ctype = header(scope, b"content-type")
        if ctype is None or ctype.split(b";")[0].strip().lower() != b"application/json":
            raise ApiError("unsupported_media_type", "the request body must be application/json")

    async def _generate(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        self._check_ready()
        self._require_json(scope)
        prepare = native_preparer(
            codec=self._codec,
            config=self.config,
            limits=self._limits(),
            tokenize=self._tokenize,
            request_id=request_id,
            check=self._engine_check,
        )
        await run_generation(
            self._generation_context(),
            scope=scope,
            receive=receive,
            send=send,
            request_id=request_id,
            request_id_header=b"x-request-id",
            endpoint="/v1/generate",
            responder=NativeResponder(self._model_summary()),
            prepare=prepare,
        )

    def _public_ids(self) -> dict[str, bool]:
        assert self.model is not None
        return {self.public_id: True, self.model.identity.model_id: True}

    async def _models(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        self._check_ready()
        body = dumps({"object": "list", "data": [model_card(self.public_id, self._created)]})
        await send_bytes(send, 200, body, [(b"x-request-id", request_id.encode())])

    async def _model_one(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        self._check_ready()
        name = scope["path"].removeprefix("/v1/models/")
        if name not in self._public_ids():
            raise ApiError(
                "model_not_found",
                "no such model is served here; see GET /v1/models",
                param="model",
                code="model_not_found",
            )
        body = dumps(model_card(self.public_id, self._created))
        await send_bytes(send, 200, body, [(b"x-request-id", request_id.encode())])

    async def _openai_generation(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
        *,
        chat: bool,
    ) -> None:
        self._check_ready()
        self._require_json(scope)
        assert self.model is not None
        if chat:
            prepare = chat_preparer(
                codec=self._openai,
                config=self.config,
                limits=self._limits(),
                template=self.model.tokenizer.chat_template,
                public_ids=self._public_ids(),
                tokenize=self._tokenize,
                request_id=request_id,
                check=self._engine_check,
            )
        else:
            prepare = completion_preparer(
                codec=self._openai,
                config=self.config,
                limits=self._limits(),
                public_ids=self._public_ids(),
                tokenize=self._tokenize,
                request_id=request_id,
                check=self._engine_check,
            )
        await run_generation(
            self._generation_context(),
            scope=scope,
            receive=receive,
            send=send,
            request_id=request_id,
            request_id_header=b"x-request-id",
            endpoint=scope["path"],
            responder=OpenAIResponder(self.public_id, chat=chat),
            prepare=prepare,
        )

    async def _chat(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        await self._openai_generation(scope, receive, send, request_id, chat=True)

    async def _completions(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        await self._openai_generation(scope, receive, send, request_id, chat=False)

    async def _messages(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        self._check_ready()
        self._require_json(scope)
        assert self.model is not None
        # The Anthropic `model` field is a label, echoed back as sent.
        responder = AnthropicResponder(self.public_id)
        prepare = messages_preparer(
            codec=self._anthropic,
            config=self.config,
            limits=self._limits(),
            template=self.model.tokenizer.chat_template,
            tokenize=self._tokenize,
            request_id=request_id,
            check=self._engine_check,
            on_label=lambda label: setattr(responder, "label", label),
        )
        await run_generation(
            self._generation_context(),
            scope=scope,
            receive=receive,
            send=send,
            request_id=request_id,
            request_id_header=b"request-id",
            endpoint="/v1/messages",
            responder=responder,
            prepare=prepare,
        )

    async def _count_tokens(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        request_id: str,
    ) -> None:
        """Counts with the same template as /v1/messages, without generating (and without
        taking a place in the scheduler: it never reaches the engine)."""
        self._check_ready()
        self._require_json(scope)
        assert self.model is not None
        body = await read_body(
            scope,
            receive,
            self.config.max_request_bytes,
            trio.current_time() + self.config.read_timeout_s,
        )
        req = self._anthropic.parse_count(loads(body))
        prompt = render_conversation(
            self.model.tokenizer.chat_template, req.system_text(), req.messages
        )
        count = len(await self._tokenize(prompt))
        await send_bytes(
            send, 200, dumps({"input_tokens": count}), [(b"request-id", request_id.encode())]
        )


def create_app(config: ServerConfig | None = None, **kwargs: Any) -> App:
    """The ASGI app. Without a config, settings come from NINFER_* variables and the TOML
    file named by NINFER_CONFIG (read once, here)."""
    if config is None:
        config = config_from_env(os.environ)
    return App(config, **kwargs)
