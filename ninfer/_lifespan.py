"""What lives from start-up to shutdown: the engine and its loading, the request log,
the metrics, and once the model is loaded, what serving needs (scheduler, frontends,
request flow); readiness, the drain, and the periodic statistics.

`ninfer._app` routes requests; this module decides whether they can be served.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio

from ninfer._artifacts import REGISTRY, cache_dir, resolve_model
from ninfer._bridge import EngineHost, EngineService, ThreadedEngine
from ninfer._chat_templates import chat_template_source
from ninfer._config import ServerConfig, public_settings, redacted_argv
from ninfer._estimate import ServiceTimes
from ninfer._flow import FlowContext
from ninfer._http import client_address, trusted_networks
from ninfer._metrics import Metrics
from ninfer._requestlog import RequestLog
from ninfer._streams import StreamSessions
from ninfer.engine import (
    ChatText,
    EngineConfig,
    EngineStatistics,
    ServedModel,
)
from ninfer.frontends import FRONTENDS, FrontendContext, GrammarCompiler, Routed, sampling_record
from protocols import ApiError
from scheduler import AdmissionController, SchedulerStatistics

__all__ = ["Lifespan", "Serving", "redact_paths"]

# Filesystem paths in an error message (replaced before it leaves the process).
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s\\/:'\"]+){2,}[\\/]?")

# Prompts longer than this many characters are tokenized on a worker thread.
_INLINE_TOKENIZE_CHARS = 4096

T = TypeVar("T")


def redact_paths(text: str) -> str:
    """`text` with filesystem paths replaced: none leaves the process in an answer."""
    return _PATH.sub("<path>", text)


@attrs.define
class Serving:
    """What exists once the model is loaded."""

    model: ServedModel
    scheduler: AdmissionController
    flow: FlowContext
    frontends: FrontendContext
    by_class: dict[type[Routed], Routed]  # one of each of FRONTENDS


class Lifespan:
    """One model, one engine, one request log; `run` is the ASGI lifespan's body."""

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
        self._started = time.monotonic()  # `ready` says how long start-up took in all
        self._binds_itself = binds_itself  # False: the server running the app chose the address
        self.log = RequestLog(config.request_log_jsonl)
        self.diagnostics = self.log.diagnostics()
        self._argv = redacted_argv(list(argv if argv is not None else sys.argv), config.api_key)
        self._model_path = model_path
        if engine is None:
            cache = cache_dir(config.cache_dir, os.environ)
            engine = ThreadedEngine(
                self._resolve_model,
                EngineConfig(
                    max_batch=config.max_concurrency,
                    kv_capacity=config.kv_capacity or config.max_context or 8192,
                    page_size=16,
                    prefill_chunk=config.prefill_chunk,
                    prefix_cache=not config.no_prefix_cache,
                    max_context=config.max_context,
                    dtype=config.dtype,
                    weights=config.weights,
                    device=config.device,
                    chat_template=chat_template_source(config.chat_template),
                    spec=config.spec,
                    draft_tokens=config.draft_tokens,
                    kv_dtype=config.kv_dtype,
                    kernels=config.kernels,
                    threads=config.threads,
                    cache_dir=str(cache),
                    check_cache=str(cache / "checks") if config.self_check == "cached" else None,
                    packed_cache=None if config.no_packed_cache else str(cache / "packed"),
                ),
                threads=config.threads,
                log=self.diagnostics,
                progress=self.log.console,
            )
        self.service = EngineService(engine, log=self.diagnostics)
        self.serving: Serving | None = None
        self.metrics = Metrics(
            lambda: self.serving.scheduler.statistics() if self.serving else None,
            self.service.statistics,
            lambda: (self.log.failure is not None, self.log.dropped),
        )
        self.log.subscribe(self.metrics.on_event)
        names = config.served_model_name
        self.public_id = names[0] if names else ""
        self.served_names: tuple[str, ...] = names or ()
        self.draining = False
        self._started_at: float | None = None  # Trio time the lifespan began loading
        self._drain_started_at: float | None = None
        self.settled = trio.Event()  # set once the model is loaded and admitting, or failed
        self._background = trio.CancelScope()  # the periodic tasks, cancelled at shutdown
        self._tokenize_limiter = trio.CapacityLimiter(2)
        self.created = int(time.time())

    def _resolve_model(self) -> str:
        """The model file (fetched on first use); called on the engine thread."""
        if self._model_path is not None:
            return self._model_path
        cfg = self.config
        where = cache_dir(cfg.cache_dir, os.environ)
        return str(resolve_model(cfg.model, where, progress=self.log.console))

    # ---- start-up and shutdown ----------------------------------------------------------

    async def run(
        self, started: Callable[[], Awaitable[None]], stopping: Callable[[], Awaitable[object]]
    ) -> None:
        """Start the engine (loading goes on in the background), call `started`, serve
        until `stopping` returns, then stop the engine and close the log (server_stop is
        its last record)."""
        self._started_at = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.service.run)
                nursery.start_soon(self._after_load, nursery)
                await started()
                await stopping()
                # Hypercorn has finished (or cancelled) every request by now.
                self.begin_drain()
                self._background.cancel()
                self.service.shutdown()  # the engine loop returns; service.run ends
        finally:
            self.log.emit("server_stop")
            self.log.close()

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
        # The names a request may give, and /v1/models lists: the served names, else the
        # public id alone (the file's own id, say smollm2-135m-8k-lc100k-mix1-ep2, is
        # nothing a newcomer can place).
        self.served_names = names or (self.public_id,)
        self.serving = self._build_serving(model)
        ident = model.identity
        settings = public_settings(self.config)
        if not self._binds_itself:
            settings.update(host=None, port=None)
        self.log.emit(
            "server_start",
            config=settings,
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
                "prefill_together_rows": model.prefill_together_rows,
                "speculative": model.speculative,
                "self_check": [r.as_dict() for r in model.self_check],
                "kv_sizing": model.kv_sizing.as_dict() if model.kv_sizing else None,
            },
            sampling_defaults=sampling_record(self.config, model.sampling_preset),
        )
        if model.kv_sizing is not None:
            sizing = model.kv_sizing
            self.log.console(
                "kv_pool",
                mode=sizing.mode,
                kv_dtype=sizing.kv_dtype,
                tokens=sizing.tokens,
                bytes_per_token=sizing.bytes_per_token,
                pool_mib=round(sizing.pool_bytes / 2**20, 1),
                free_mib=round(sizing.available_bytes / 2**20, 1),
                kept_free_mib=round(sizing.headroom_bytes / 2**20, 1),
                memory=sizing.memory_source,
            )
        self.log.console(
            "ready",
            model=self.public_id,
            sha256=ident.sha256[:12],
            load_s=round(model.load_seconds, 2),
            since_start_s=round(time.monotonic() - self._started, 1),
        )
        self.settled.set()
        if self.config.log_stats_interval_ms > 0:
            nursery.start_soon(self._statistics_loop)

    def _build_serving(self, model: ServedModel) -> Serving:
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
            tokenize=self.tokenize,
            created=self.created,
            grammars=GrammarCompiler(model.compile_grammar, self._tokenize_limiter),
            offload=self.offload,
        )
        flow = FlowContext(
            scheduler=scheduler,
            engine=self.service,
            log=self.log,
            max_request_bytes=cfg.max_request_bytes,
            read_timeout_s=cfg.read_timeout_s,
            write_timeout_s=cfg.write_timeout_s,
            pending_timeout_s=cfg.pending_timeout_ms / 1000.0,
            pages_needed=model.pages_needed,
            draining=lambda: self.shutting_down() if self.draining else None,
            service_times=service_times,
            on_tokens=self.metrics.inter_token,
            streams=StreamSessions(cfg.stream_resume_s),
            client_of=functools.partial(
                client_address, trusted=trusted_networks(cfg.trusted_proxies)
            ),
        )
        return Serving(
            model=model,
            scheduler=scheduler,
            flow=flow,
            frontends=ctx,
            by_class={cls: cls(ctx) for cls in FRONTENDS},
        )

    @property
    def model(self) -> ServedModel | None:
        """The model being served (None until it is ready)."""
        return self.serving.model if self.serving else None

    @property
    def scheduler(self) -> AdmissionController | None:
        """The admission scheduler (None until the model is ready)."""
        return self.serving.scheduler if self.serving else None

    def begin_drain(self) -> None:
        """Stop admitting: new generation requests get 503 shutting_down."""
        if not self.draining:
            self.draining = True
            self._drain_started_at = trio.current_time()
            self.log.console("draining: new requests are refused, in-flight ones finish")

    def shutting_down(self) -> ApiError:
        """The refusal while draining; Retry-After is what remains of the drain (after
        which this process is gone, and a supervisor may have started another)."""
        began = self._drain_started_at if self._drain_started_at is not None else 0.0
        left = max(1.0, self.config.graceful_timeout_s - (trio.current_time() - began))
        return ApiError("shutting_down", "the server is shutting down", retry_after=left)

    # ---- readiness -----------------------------------------------------------------------

    def ready(self) -> Serving:
        """What a model route needs, or the readiness refusal (503 with Retry-After)."""
        if self.draining:
            raise self.shutting_down()
        state = self.service.state()
        if state.phase == "loading" or (state.phase == "ready" and self.serving is None):
            # As long again as it has taken so far: loading time is not known in advance.
            began = self._started_at if self._started_at is not None else trio.current_time()
            loading_for = max(1.0, trio.current_time() - began)
            raise ApiError("model_loading", "the model is still loading", retry_after=loading_for)
        if state.phase != "ready":
            raise self.engine_down(state.error)
        if state.stalled:
            raise ApiError(
                "engine_unavailable", "the engine has stopped making progress", retry_after=5
            )
        assert self.serving is not None
        return self.serving

    def alive(self) -> None:
        """Liveness: nothing while the engine loads or runs; the refusal once it has died
        (or failed to load), so that a supervisor restarts the process."""
        state = self.service.state()
        if state.phase == "failed":
            raise self.engine_down(state.error)

    def engine_down(self, error: str | None) -> ApiError:
        """The engine has stopped: say why (paths redacted: none leaves the process)."""
        why = f": {redact_paths(error)}" if error else ""
        return ApiError("engine_unavailable", f"the engine is not running{why}", retry_after=5)

    def log_health(self) -> dict[str, Any]:
        """The request log's state for /ready: serving goes on when it has failed (an
        operator's matter), said there, on /metrics, and once on the console."""
        health: dict[str, Any] = {"ok": self.log.failure is None, "dropped": self.log.dropped}
        if self.log.failure is not None:
            health["error"] = redact_paths(self.log.failure)
        return health

    async def offload(self, work: Callable[[], T]) -> T:
        """`work()` on a worker thread, with the threads that tokenize long texts."""
        return await trio.to_thread.run_sync(work, limiter=self._tokenize_limiter)

    async def tokenize(self, prompt: str | ChatText, *, special: bool = True) -> list[int]:
        """A prompt's ids (a rendered chat's client text never a control token; a text's
        control tokens' texts read as those tokens unless `special` is false), on a
        worker thread when it is long."""
        assert self.serving is not None
        tok = self.serving.model.tokenizer
        if isinstance(prompt, ChatText):
            length, encode = len(prompt.text), functools.partial(tok.encode_chat, prompt)
        else:
            method = tok.encode if special else tok.encode_plain
            length, encode = len(prompt), functools.partial(method, prompt)
        if length <= _INLINE_TOKENIZE_CHARS:
            return encode()
        return await trio.to_thread.run_sync(encode, limiter=self._tokenize_limiter)

    # ---- periodic statistics ---------------------------------------------------------------

    async def _statistics_loop(self) -> None:
        with self._background:
            interval = self.config.log_stats_interval_ms / 1000.0
            prev = self._statistics()
            while True:
                await trio.sleep(interval)
                cur = self._statistics()
                self._report(interval, prev, cur)
                prev = cur

    def _statistics(self) -> tuple[EngineStatistics | None, SchedulerStatistics | None]:
        return self.service.statistics(), (
            self.serving.scheduler.statistics() if self.serving else None
        )

    def _report(
        self,
        interval: float,
        prev: tuple[EngineStatistics | None, SchedulerStatistics | None],
        cur: tuple[EngineStatistics | None, SchedulerStatistics | None],
    ) -> None:
        """One `throughput` record and one console line per busy interval (as vLLM's and
        llama.cpp's servers print); idle intervals are skipped."""
        (was, sched_was), (now, sched) = prev, cur
        if was is None or now is None or sched_was is None or sched is None:
            return
        steps = now.decode_steps - was.decode_steps
        generated = now.generated_tokens - was.generated_tokens
        prefill = now.prefill_tokens - was.prefill_tokens
        admitted = sched.admitted_total - sched_was.admitted_total
        refused = sched.rejected_total - sched_was.rejected_total
        if steps == 0 and prefill == 0 and not now.busy and not admitted and not refused:
            return
        rows = now.decode_rows - was.decode_rows
        running = now.decoding + now.prefilling
        self.log.emit(
            "throughput",
            interval_seconds=interval,
            generated_tokens=generated,
            prefill_tokens=prefill,
            decode_steps=steps,
            generated_tokens_per_second=generated / interval,
            prefill_tokens_per_second=prefill / interval,
            avg_decode_batch=rows / steps if steps else 0.0,
            running=running,
            waiting=sched.waiting,
            kv_pages_used=now.pages_used,
            kv_pages_free=now.pages_free,
        )
        pages = now.pages_used + now.pages_free
        self.log.console(
            "stats",
            admitted=admitted,
            refused=refused,
            running=running,
            waiting=sched.waiting,
            gen_tok_s=round(generated / interval, 1),
            prompt_tok_s=round(prefill / interval, 1),
            kv_used=f"{100.0 * now.pages_used / pages:.1f}%" if pages else "0.0%",
        )
