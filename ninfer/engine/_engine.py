"""The engine: one thread owns torch, the model, the KV cache and every sampler.

`submit` and `cancel` are thread-safe and never block: they put a command on a
queue that the engine thread drains at each step boundary. Each loop iteration
runs at most one prefill chunk (of the request at the head of the prefill
queue) and then one decode step over every decode-ready request, as one batch
of exactly that many rows. The step's events leave in one `EventSink.deliver`
call. A request ends with exactly one `Finish` event.
"""

from __future__ import annotations

import itertools
import queue
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import structlog
import torch
from structlog.typing import FilteringBoundLogger

from ninfer.engine._contract import (
    GRAMMAR_LIMIT,
    KV_HEADROOM_BYTES,
    KV_MEMORY,
    KV_MEMORY_FLOOR_BYTES,
    CompiledGrammar,
    EngineConfig,
    EngineStatistics,
    EngineTimings,
    Event,
    EventSink,
    Finish,
    FinishReason,
    GenerationRequest,
    KVSizing,
    PathCheck,
    RequestHandle,
    ServedModel,
    TokenDelta,
    TokenLogprob,
    Usage,
    misfit,
    reserved_pages,
)
from ninfer.engine._errors import ConfigError, EngineStopped, RequestInvalid
from ninfer.engine._gguf import ModelArgs
from ninfer.engine._grammar import (
    Constraint,
    GrammarLimitReached,
    GrammarVocabulary,
    TokenDigits,
    grammar_tokenizer,
)
from ninfer.engine._invariance import invariant_batch_sizes, rows_independent_of_count
from ninfer.engine._kvpool import PagePool, page_keys, pages_for
from ninfer.engine._loader import LoadedModel, trim_heap
from ninfer.engine._memory import available_memory
from ninfer.engine._model import KVPages, Transformer
from ninfer.engine._sampling import RowSampler, logprobs_of, sample_rows
from ninfer.engine._selfcheck import SelfCheck, probe_tokens
from ninfer.engine._speculative import RowSpeculation, group_lengths, plan_drafts, step_logits
from ninfer.engine._textstream import TextStream

__all__ = ["DTYPES", "Engine"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# The prefill rate is reported once this many (decayed) prompt tokens were measured.
PREFILL_RATE_MIN_TOKENS = 64
# How many recent steps `slowest_recent_step` looks at.
RECENT_STEPS = 64
# The decode pace (`decode_step_seconds`, what Retry-After is estimated from) is the
# median of this many recent intervals between decode steps: one slow step (a
# collection, a thread taken off its core) moved a moving average 8x on a fast model
# and told refused clients seconds where a place came back in a quarter of one.
PACE_STEPS = 32
# Rows of the pass whose cost is measured against one row's (_measure_row_cost).
ROW_COST_ROWS = 17
# A prefill chunk deep into a long prompt is never cut below this many tokens.
MIN_DEEP_CHUNK = 16
# A prompt whose tokens are scored (prompt logprobs, echo) is background work: while
# other requests decode, its passes come at most once every this many decode steps, so
# that most of their tokens come at the pace they had before (docs/engine.md).
SCORE_EVERY = 3
# The least seconds between two readings of the memory left for never-used KV pages on
# the CPU (a reading takes ~0.3 ms; the pool reads only when it takes such pages).
MEMORY_READ_EVERY_S = 0.1
# Attention's arithmetic per key is this many times less efficient than the matrices'
# (measured on SmolLM2 on the 2-core machine: a prompt token costs 1.65 ms in the
# matrices and 1.5 us per key it attends to, where their arithmetic says 3,070 keys a
# token's matrices: a ratio of 3).
ATTENTION_INEFFICIENCY = 3.0


def keys_per_token(args: ModelArgs) -> float:
    """How many keys a prompt token attends to for its attention to cost what its
    weight matrices do (from the model's shape, with ATTENTION_INEFFICIENCY)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    matrices = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.ffn_dim
    per_key = 2 * args.n_heads * args.head_dim  # scores and values, per layer
    return max(1.0, matrices / per_key / ATTENTION_INEFFICIENCY)


@attrs.frozen
class _Submit:
    handle: RequestHandle
    request: GenerationRequest
    submitted: float  # time.perf_counter()


@attrs.frozen
class _Cancel:
    handle: RequestHandle


@attrs.frozen
class _Pause:
    handle: RequestHandle
    paused: bool


@attrs.frozen
class _Shutdown:
    pass


_Command = _Submit | _Cancel | _Pause | _Shutdown


@attrs.define(eq=False)
class _Active:
    handle: RequestHandle
    request: GenerationRequest
    sampler: RowSampler
    text: TextStream
    submitted: float
    pages: list[int] = attrs.field(factory=list)
    prefilled: int = 0  # prompt tokens in the cache
    position: int = 0  # next position to write
    last_token: int = -1
    generated: int = 0
    prefill_start: float = 0.0
    decode_start: float = 0.0
    pending_ids: list[int] = attrs.field(factory=list)
    output_ids: list[int] = attrs.field(factory=list)  # every token sampled
    paused: bool = False  # its reader is far behind: left out of decode steps until it reads
    cached: int = 0  # prompt tokens whose pages were shared from the prefix cache
    page_keys: list[bytes] = attrs.field(factory=list)  # of the prompt's full pages
    delivered: bool = False  # a TokenDelta has been sent (the first carries `cached`)
    pending_lps: list[TokenLogprob] = attrs.field(factory=list)  # of pending_ids, if asked
    prompt_lps: list[TokenLogprob | None] | None = None  # when prompt_logprobs is asked
    spec: RowSpeculation | None = None  # its drafting, when the engine speculates


class Engine:
    """Owns the model on one thread. Construct, then call `run` on a thread of its own."""

    def __init__(
        self,
        loader: Callable[[], LoadedModel],
        config: EngineConfig,
        sink: EventSink,
        *,
        log: FilteringBoundLogger | None = None,
    ) -> None:
        self._loader = loader
        # Without a logger of the server's, diagnostics still go to stderr, never to
        # stdout, where a program using the engine writes its own output.
        self._log: FilteringBoundLogger = (
            log if log is not None else structlog.wrap_logger(structlog.PrintLogger(sys.stderr))
        )
        self.config = config
        self._sink = sink
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._state = "starting"
        self.model: LoadedModel | None = None
        self.max_context = 0
        self._pool: PagePool | None = None
        self._sizing: KVSizing | None = None  # how the pool was sized (_size_pool)
        self._waiting: deque[_Active] = deque()
        self._decoding: list[_Active] = []
        self._by_id: dict[int, _Active] = {}
        self._load_seconds = 0.0  # from reading the file to ready (run sets it)
        self._lltokenizer: Any = None  # llguidance's token table, on first use
        self._token_digits: Any = None  # the digit cap's (TokenDigits), built with it
        self._lltokenizer_lock = threading.Lock()
        self._events: list[tuple[RequestHandle, Event]] = []
        self._steps = 0
        self._decode_steps = 0
        self._decode_rows = 0
        self._prefill_tokens = 0
        self._prefill_passes = 0
        self._cached_tokens = 0
        self._generated = 0
        self._pace = StepPace()  # seconds between consecutive decode steps
        # tokens a decode step gives a row (1 without speculation; a moving average)
        self._row_tokens_ema = 1.0
        # prefill seconds and tokens, decaying sums: their ratio weighs each chunk by its
        # tokens, so that the fixed cost of a tiny prompt does not pass for a rate
        self._prefill_seconds = 0.0
        self._prefill_counted = 0.0
        # scoring prompt tokens (the head over a chunk's rows, their logprobs): seconds
        # and tokens likewise; and the decode steps since the last scoring pass
        self._score_seconds = 0.0
        self._score_counted = 0.0
        self._since_score = SCORE_EVERY
        # Whether reservations find no memory for their pages (said once, until they do).
        self._memory_was_short = False
        self._last_decode_end: float | None = None
        self._last_progress = time.monotonic()
        # How long the recent steps took (what a stall is judged against).
        self._recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._stats_lock = threading.Lock()
        self.batch_invariant = False
        self._batch_sizes: list[int] = [1]
        # Rows a pass may have when prompts are prefilled together: 0 when they cannot be
        # (the layers' matmuls compute a row differently in another number of rows).
        self._together_rows = 0
        self._keys_per_token = 1e12  # set once the model is known (_chunk_at)
        self._self_check: tuple[PathCheck, ...] = ()
        # Speculative decoding as it runs ("none" until the start-up checks allow it).
        self._spec = "none"
        self._spec_rounds = 0
        self._drafted = 0
        self._accepted = 0
        # What a pass costs per row against its fixed cost, c1 / c0 inverted (measured
        # once the engine is warm: _measure_row_cost); the recent chance that a drafted
        # token is kept, over every row (a new row's prior).
        self._row_cost = 9.0
        self._spec_prior = 0.5
        self._kernel_solo_calls = 0  # from the native kernels' pool (`_step`)

    # ---- thread-safe API -------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestInvalid when the request can never run here."""
        if self.model is None:
            raise EngineStopped("the model is not loaded")
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestInvalid("the prompt has no tokens", param="prompt")
        if request.max_new_tokens < 1:
            raise RequestInvalid("max_new_tokens must be at least 1", param="max_new_tokens")
        vocab = self.model.identity.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_ids):
            raise RequestInvalid("a prompt token id is outside the vocabulary", param="prompt")
        assert self._pool is not None
        wrong = misfit(n, request.max_new_tokens, max_context=self.max_context,
                       kv_pages=self._pool.n_pages, page_size=self.config.page_size)  # fmt: skip
        if wrong is not None and wrong.limit == "context":
            raise RequestInvalid(
                f"prompt ({n} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context window of {self.max_context} tokens",
                param="max_new_tokens",
            )
        reserve = request.reserve_tokens
        if reserve is not None and not 1 <= reserve <= request.max_new_tokens:
            raise RequestInvalid("reserve_tokens must be 1..max_new_tokens", param="max_new_tokens")
        if wrong is not None:
            raise RequestInvalid(
                f"prompt plus max_new_tokens needs {wrong.pages} KV pages; the pool has "
                f"{self._pool.n_pages}",
                param="max_new_tokens",
            )

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; never blocks. Raises RequestInvalid or EngineStopped."""
        if self._state != "ready":
            raise EngineStopped(f"the engine is {self._state}")
        self.check(request)
        handle = RequestHandle(id=next(self._ids), request_id=request.request_id)
        self._commands.put(_Submit(handle, request, time.perf_counter()))
        return handle

    def pause(self, handle: RequestHandle, paused: bool) -> None:
        """Leave a decoding request out of decode steps (its pages kept) until resumed:
        for a reader that has fallen far behind, so that the others' steps do not pay
        for tokens nobody is reading yet. Non-blocking."""
        self._commands.put(_Pause(handle, paused))

    def cancel(self, handle: RequestHandle) -> None:
        """Ask the engine to drop a request at the next step boundary; never blocks."""
        self._commands.put(_Cancel(handle))

    def shutdown(self) -> None:
        """Ask the loop to cancel everything and return; never blocks."""
        self._commands.put(_Shutdown())

    def served(self) -> ServedModel:
        """The loaded model and this engine's limits, as the server may see them."""
        assert self.model is not None, "only once ready"
        assert self._pool is not None
        return ServedModel(
            identity=self.model.identity,
            tokenizer=self.model.tokenizer,
            load_seconds=self._load_seconds,
            max_context=self.max_context,
            page_size=self.config.page_size,
            kv_pages=self._pool.n_pages,
            dtype=self.config.dtype,
            device=self.config.device,
            batch_invariant=self.batch_invariant,
            batch_sizes=tuple(self._batch_sizes),
            prefill_together_rows=self._together_rows,
            self_check=self._self_check,
            kernels=self.model.kernels,
            speculative=self._spec,
            compile_grammar=self.compile_grammar,
            sampling_preset=self.model.sampling_preset,
            kv_sizing=self._sizing,
        )

    def statistics(self) -> EngineStatistics:
        with self._stats_lock:
            pool = self._pool
            prefilling = 1 if self._waiting and self._waiting[0].pages else 0
            return EngineStatistics(
                state=self._state,
                waiting=len(self._waiting) - prefilling,
                prefilling=prefilling,
                decoding=len(self._decoding),
                pages_total=pool.n_pages if pool else 0,
                pages_used=pool.used if pool else 0,
                pages_free=pool.free if pool else 0,
                steps=self._steps,
                last_progress=self._last_progress,
                slowest_recent_step=max(self._recent_steps, default=0.0),
                busy=bool(self._waiting) or any(not a.paused for a in self._decoding),
                batch_invariant=self.batch_invariant,
                batch_sizes=tuple(self._batch_sizes),
                decode_steps=self._decode_steps,
                decode_rows=self._decode_rows,
                prefill_tokens=self._prefill_tokens,
                prefill_passes=self._prefill_passes,
                cached_prompt_tokens=self._cached_tokens,
                pages_cached=pool.cached if pool else 0,
                generated_tokens=self._generated,
                decode_step_seconds=self._pace.seconds(),
                decode_tokens_per_row=self._row_tokens_ema,
                prefill_seconds_per_token=(
                    self._prefill_seconds / self._prefill_counted
                    if self._prefill_counted >= PREFILL_RATE_MIN_TOKENS
                    else 0.0
                ),
                spec_rounds=self._spec_rounds,
                drafted_tokens=self._drafted,
                accepted_tokens=self._accepted,
                kernel_solo_calls=self._kernel_solo_calls,
            )

    # ---- the engine thread ------------------------------------------------------------

    def run(self, on_ready: Callable[[ServedModel], None] = lambda _m: None) -> None:
        """Load, warm up and serve until `shutdown`. Runs on the engine thread."""
        try:
            with torch.inference_mode():
                self._state = "loading"
                began = time.perf_counter()
                self._setup(self._loader())  # (no name kept: the file's map goes with it)
                if self._transformer.native is not None:
                    # The native kernels have their own threads; torch's ops between their
                    # calls (sampling, a step's bookkeeping) are small, and on torch's
                    # threads they left OpenMP workers spinning on the cores the kernels'
                    # threads need (a decode step took 11 ms instead of 5.6 beside a
                    # sampled row's softmax).
                    torch.set_num_threads(1)
                self._warm_up()
                if self._spec != "none":
                    self._measure_row_cost()
                # Reading, the self-check, warming up: all that `ready` waited for.
                self._load_seconds = time.perf_counter() - began
                self._state = "ready"
                on_ready(self.served())
                self._loop()
                self._state = "stopped"
        except BaseException as exc:
            self._state = "failed"
            self._fail_all(f"engine failed: {type(exc).__name__}")
            raise
        finally:
            self._flush()

    def _size_pool(self, loaded: LoadedModel) -> KVSizing:
        """The pool's size in tokens, against the memory left after the weights: as many
        whole pages as fit with KV_HEADROOM_BYTES to spare (--kv-capacity auto; fewer
        than one sequence is refused), or the capacity asked for, never reduced (refused
        where it cannot fit at all)."""
        cfg = self.config
        args, dtype = loaded.transformer.args, loaded.transformer.dtype
        kv_dtype = cfg.kv_dtype
        per_token = KVPages.bytes_per_token(args, dtype, kv_dtype)
        page_bytes = per_token * cfg.page_size
        available, source = available_memory(cfg.device)
        free = f"{_gib(available)} are free after the weights ({source})"
        if cfg.kv_capacity == "auto":  # the padding and scratch pages fit too
            pages = max(0, (available - KV_HEADROOM_BYTES) // page_bytes - 2)
            if pages * cfg.page_size < self.max_context:
                raise ConfigError(
                    f"--kv-capacity auto: {free}; with {_gib(KV_HEADROOM_BYTES)} kept free, "
                    f"{pages * cfg.page_size} tokens fit ({per_token} bytes each), fewer than "
                    f"one sequence of {self.max_context} (--max-context): free memory or "
                    "lower --max-context"
                )
            headroom = KV_HEADROOM_BYTES
        else:
            pages = pages_for(cfg.kv_capacity, cfg.page_size)
            headroom = 0
        pool_bytes = (pages + 2) * page_bytes  # with the padding and scratch pages
        if pool_bytes > available:  # an explicit capacity (auto's fits by construction)
            raise ConfigError(
                f"--kv-capacity {cfg.kv_capacity} needs {_gib(pool_bytes)} for its KV pool "
                f"({per_token} bytes a token); {free}: lower it, or give auto"
            )
        return KVSizing(
            mode="auto" if cfg.kv_capacity == "auto" else "explicit",
            kv_dtype="int8" if kv_dtype == "int8" else str(dtype).removeprefix("torch."),
            tokens=pages * cfg.page_size,
            bytes_per_token=per_token,
            pool_bytes=pool_bytes,
            available_bytes=available,
            memory_source=source,
            headroom_bytes=headroom,
        )

    def _memory_room(self, sizing: KVSizing) -> Callable[[], int] | None:
        """On the CPU, how many more pages the machine has memory for now, with
        KV_MEMORY_FLOOR_BYTES left (the pool's memory is committed page by page as
        pages are first written, and others may take memory meanwhile); None on CUDA,
        where the whole pool is committed when it is made."""
        device = self.config.device
        if device.startswith("cuda"):
            return None
        per_page = self.config.page_size * sizing.bytes_per_token
        return lambda: (available_memory(device)[0] - KV_MEMORY_FLOOR_BYTES) // per_page

    def _setup(self, loaded: LoadedModel) -> None:
        cfg = self.config
        ctx = loaded.identity.context_length
        self.max_context = min(cfg.max_context or ctx, ctx)
        self._sizing = self._size_pool(loaded)
        n_pages = self._sizing.tokens // cfg.page_size
        self._pool = PagePool(
            n_pages=n_pages,
            page_size=cfg.page_size,
            room=self._memory_room(self._sizing),
            room_every_s=MEMORY_READ_EVERY_S,
        )
        self.model = loaded
        model = loaded.transformer
        self._keys_per_token = keys_per_token(model.args)
        check = None
        if loaded.source is not None:  # a model loaded from its file: check what runs it
            tokens = probe_tokens(loaded.tokenizer, loaded.identity.vocab_size)
            check = SelfCheck(model, loaded.source, tokens, weights=cfg.weights)
            check.kernels()  # falls back where a kernel is wrong; raises where none is right
            if model.native is None and loaded.kernels.startswith("native"):
                refused = "torch (the self-check refused the native kernels)"
                loaded = attrs.evolve(loaded, kernels=refused)
                self.model = loaded
        # After the kernel check: the native layers keep their keys transposed, torch's not.
        self._kv = KVPages.allocate(
            model.args, n_pages=n_pages, page_size=cfg.page_size, dtype=model.dtype,
            device=cfg.device, kv_dtype=cfg.kv_dtype, keys_transposed=model.native is not None,
        )  # fmt: skip
        sizes = invariant_batch_sizes(model.row_maps(), max_rows=cfg.max_batch, device=cfg.device)
        # Narrowing rounds those matrices' inputs and weights to bfloat16, and oneDNN's
        # bfloat16 matmuls give a row a result that depends on how many rows a prefill
        # chunk has: only worth it when float32 would pad most decode steps.
        if model.narrowable and len(sizes or ()) * 2 < cfg.max_batch:
            narrow = invariant_batch_sizes(
                model.row_maps(narrowed=True), max_rows=cfg.max_batch, device=cfg.device
            )
            better = narrow is not None and len(narrow) > len(sizes or ())
            if better and (check is None or check.narrowed()):
                model.narrow_dense()
                self._log.info("dense_weights_narrowed", dtype="bfloat16", batch_sizes=narrow)
                sizes = narrow
        self._batch_sizes = sizes or list(range(1, cfg.max_batch + 1))
        # Prompts are prefilled in one pass only if that changes none of their numbers:
        # measured on each kind of matrix of the layers (up to 1,024 rows a pass), then
        # on the model whole with real prompts.
        together = min(cfg.prefill_chunk, 1024)
        independent = sizes is not None and rows_independent_of_count(
            model.layer_maps(), max_rows=together, device=cfg.device
        )
        if independent and (check is None or check.together(cfg.page_size)):
            self._together_rows = together
        # bfloat16 is never promised: batched rows were seen to drift from the same rows
        # alone on this CPU even with every linear shape measured invariant.
        self.batch_invariant = sizes is not None and cfg.dtype == "float32"
        invariant = self.batch_invariant
        if check is not None and invariant and not check.decode_batch(cfg.page_size, self._padded):
            self._batch_sizes = [cfg.max_batch]  # every row computed as in the largest
            self.batch_invariant = check.decode_batch(
                cfg.page_size, self._padded, "decode_batch_padded"
            )
        if not self.batch_invariant:
            self._log.warning("batching_not_invariant", dtype=cfg.dtype)
        if cfg.spec != "none":
            self._setup_speculation(check)
        if check is not None:
            self._report(check)
            self.model = attrs.evolve(loaded, source=None)  # the file's map is not needed
            trim_heap()

    def _setup_speculation(self, check: SelfCheck | None) -> None:
        """Speculate (--spec) only where verifying a draft computes each position as a
        plain step would: every matrix, the head too, computes a row the same in any
        number of rows up to the most a pass can have (measured), and a verifying pass
        gives the real model's plain-step logits bit for bit (the self-check). Else the
        engine decodes without, and says why."""
        cfg = self.config
        model = self._transformer
        most = self._padded(cfg.max_batch) + cfg.max_batch * (cfg.draft_tokens + 1)
        # The layers' matrices, unless measured up to as many rows for prefilling
        # prompts together; and the head.
        measured = self._together_rows >= most
        maps = [*([] if measured else model.layer_maps()), model.lm_head]
        if not self.batch_invariant or not rows_independent_of_count(
            maps, max_rows=most, device=cfg.device
        ):
            self._log.warning(
                "fast_path_refused",
                path="speculative",
                error="a row's numbers depend on how many rows a pass has",
                instead="no speculation",
            )
            return
        if check is not None and not check.speculative(cfg.page_size, self._padded):
            return  # reported with the rest of the self-check
        self._spec = cfg.spec

    def _report(self, check: SelfCheck) -> None:
        """The self-check on the console and in the log: a warning for each path
        refused (and what runs instead), one line for the whole."""
        self._self_check = tuple(check.results)
        for r in check.results:
            if not r.ok:
                self._log.warning(
                    "fast_path_refused",
                    path=r.path,
                    error=r.error,
                    tolerance=r.tolerance,
                    instead=r.instead or None,
                )
        self._log.info(
            "self_check",
            kernels=self.model.kernels if self.model is not None else None,
            seconds=round(check.seconds, 3),
            passed=[r.path for r in check.results if r.ok],
            refused=[r.path for r in check.results if not r.ok],
        )

    def _warm_up(self) -> None:
        """One tiny prefill and decode so the first request does not pay for kernel setup."""
        assert self._pool is not None
        pages = self._pool.allocate(1)
        assert pages is not None
        self._kv.zero_pages(pages)
        model = self._transformer
        table = torch.tensor([pages], device=self.config.device)
        tokens = torch.zeros((1, 2), dtype=torch.long, device=self.config.device)
        model.forward(tokens, torch.arange(2).view(1, 2), table, self._kv, last_only=True)
        model.forward(tokens[:, :1], torch.tensor([[2]]), table, self._kv, last_only=True)
        self._pool.release(pages)

    def _measure_row_cost(self) -> None:
        """c0 / c1 of a pass costing about c0 + c1 x rows (`plan_drafts`): a pass of
        one row and one of ROW_COST_ROWS (a prompt's positions, as a verifying row
        has), each the median of five after a first. Decides how much drafting is
        worth; never what is computed."""
        assert self._pool is not None
        S = self.config.page_size
        rows = min(ROW_COST_ROWS, self.config.max_batch * (self.config.draft_tokens + 1))
        pages = self._pool.allocate(pages_for(rows, S))
        if pages is None:  # a pool too small to measure in: the default ratio stays
            return
        self._kv.zero_pages(pages)
        dev = self.config.device
        table = torch.tensor([pages], device=dev)

        def median_pass(n: int) -> float:
            group = (
                torch.zeros((1, n), dtype=torch.long, device=dev),
                torch.arange(n, device=dev).view(1, -1),
                table,
            )
            times = []
            for _ in range(6):
                began = time.perf_counter()
                step_logits(self._transformer, self._kv, None, [group])
                times.append(time.perf_counter() - began)
            return sorted(times[1:])[2]

        one, many = median_pass(1), median_pass(rows)
        self._pool.release(pages)
        per_row = max((many - one) / (rows - 1), one * 1e-4)
        self._row_cost = max(1.0, (one - per_row) / per_row)
        self._log.info(
            "speculative_decoding",
            backend=self._spec,
            draft_tokens=self.config.draft_tokens,
            pass_seconds=round(one, 4),
            row_seconds=round(per_row, 5),
        )

    def _padded(self, rows: int) -> int:
        """The batch size `rows` rows are padded to: the next one whose rows are computed
        as in any other (see _invariance)."""
        return next((n for n in self._batch_sizes if n >= rows), rows)

    @property
    def _transformer(self) -> Transformer:
        assert self.model is not None
        return self.model.transformer

    def _loop(self) -> None:
        while True:
            idle = not self._waiting and all(a.paused for a in self._decoding)
            if idle:
                self._last_decode_end = None  # time waiting for work is no step's
            if not self._drain_commands(block=idle):
                return
            try:
                self._step()
            finally:
                self._flush()

    def _drain_commands(self, *, block: bool) -> bool:
        """Apply queued commands; False on shutdown. Blocks for one when idle."""
        while True:
            try:
                if block:
                    command = self._commands.get()
                    # Progress is measured while there is work: the wait for it is none
                    # of the engine's (else the first step after a long idle looks
                    # stalled, and /ready refuses).
                    self._last_progress = time.monotonic()
                    block = False
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, _Submit):
                self._admit(command.handle, command.request, command.submitted)
            elif isinstance(command, _Pause):
                paused = self._by_id.get(command.handle.id)
                if paused is not None:
                    paused.paused = command.paused
            elif isinstance(command, _Cancel):
                active = self._by_id.get(command.handle.id)
                if active is not None:
                    self._finish(active, "cancelled")
            else:
                self._fail_all(None)
                return False

    def _admit(self, handle: RequestHandle, request: GenerationRequest, submitted: float) -> None:
        assert self.model is not None
        tok = self.model.tokenizer
        active = _Active(
            handle=handle,
            request=request,
            sampler=RowSampler.create(
                request.sampling,
                self.model.identity.vocab_size,
                native_top_p=self._transformer.native is not None,
            ),
            text=TextStream(decode=tok.decode, stops=request.stop),
            submitted=submitted,
        )
        if self._spec != "none":
            active.spec = RowSpeculation(
                window=self.config.draft_tokens, history=request.prompt_ids
            )
        self._by_id[handle.id] = active
        with self._stats_lock:
            self._waiting.append(active)
        grammar = request.sampling.grammar
        if grammar is not None:
            try:
                if isinstance(grammar, CompiledGrammar):  # compiled off this thread
                    matcher = cast(Any, grammar.matcher).deep_copy()
                else:
                    matcher = Constraint.compile(self._grammar_tokenizer(), grammar)
                # (the digit table was built with the token table `matcher` needed)
                active.sampler.constraint = Constraint(
                    matcher, self._vocab_size, self._token_digits
                )
            except Exception:
                self._fail(active, "grammar")

    @property
    def _vocab_size(self) -> int:
        assert self.model is not None
        return self.model.identity.vocab_size

    def _grammar_tokenizer(self) -> Any:
        """llguidance's table of this model's tokens, built on first use (by whichever
        thread needs it first: the engine's, or a frontend's compiling a grammar)."""
        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                assert self.model is not None
                vocab = GrammarVocabulary.of(self.model.tokenizer)
                self._token_digits = TokenDigits(vocab, self._vocab_size)
                self._lltokenizer = grammar_tokenizer(vocab, self._vocab_size)
            return self._lltokenizer

    def compile_grammar(self, grammar: str) -> CompiledGrammar:
        """`grammar` compiled for this engine, on the calling thread (a frontend's worker
        thread: the engine's own would stall every row while a large one compiles)."""
        return CompiledGrammar(grammar, Constraint.compile(self._grammar_tokenizer(), grammar))

    def _step(self) -> None:
        self._prefill()
        # A prompt's first token goes out now, not after the decode step below (which
        # would hold it back a whole step: 17 ms of SmolLM2's time to first token).
        self._flush()
        if any(not a.paused for a in self._decoding):
            self._decode_step()
        else:
            self._last_decode_end = None  # the next step's interval starts anew
        if self._transformer.native is not None and self._steps % 64 == 0:
            self._kernel_solo_calls = int(torch.ops.ninfer.pool_stats()[2])
        with self._stats_lock:
            self._steps += 1
            now = time.monotonic()
            self._recent_steps.append(now - self._last_progress)
            self._last_progress = now

    def _prefill(self) -> None:
        """Prefill chunks up to --prefill-chunk tokens in all, across as many waiting
        requests as fit whole, in order: a burst of short prompts starts decoding
        together instead of one per decode step. Every row is computed on its own, so
        a prompt's numbers never depend on what else was waiting, nor on what was cached
        (docs/engine.md, "Prefix cache"). When the model's matmuls compute a row the same
        in any number of rows (measured at start-up and by the self-check: the int4
        kernel and oneDNN's float32 matmul do), the chunks run as one pass, which pays a
        pass's fixed cost once; else one pass each."""
        budget = float(self.config.prefill_chunk)  # in tokens at depth 0 (see _chunk_at)
        group: list[_Active] = []
        rows = 0  # of the group's pass
        decoding = any(not x.paused for x in self._decoding)
        for a in list(self._waiting):
            scoring = a.request.prompt_logprobs is not None
            if scoring and decoding and self._since_score < SCORE_EVERY:
                continue  # its next pass waits for the streams' next steps
            left = len(a.request.prompt_ids) - a.prefilled
            size = min(self._chunk_at(a.prefilled), left)
            if scoring:  # a pass with its scoring costs what a plain pass does
                size = max(min(MIN_DEEP_CHUNK, size), int(size * self._plain_share()))
            cost = size * (1 + a.prefilled / self._keys_per_token)
            first = budget == self.config.prefill_chunk  # (its chunk always goes)
            if (cost > budget + 1e-9 and not first) or not self._reserve(a):
                break
            budget -= cost
            if a.request.prompt_logprobs is None and rows + size <= self._together_rows:
                group.append(a)
                rows += size
            else:  # alone, as every prompt row's logits (prompt logprobs) need it
                self._prefill_pass([a], size)
                if scoring:
                    self._since_score = 0
                    if a.prefilled >= len(a.request.prompt_ids):
                        trim_heap()  # its passes' logits: hundreds of MB, given back
            if size < left:
                break  # its next chunk comes before anyone behind it
        if group:
            self._prefill_pass(group)

    def _plain_share(self) -> float:
        """The share of a scoring pass's tokens that costs what a plain pass of the same
        tokens does: prefill seconds a token / (those + scoring seconds a token), as
        measured (a half until both are)."""
        if self._prefill_counted < PREFILL_RATE_MIN_TOKENS or self._score_counted <= 0:
            return 0.5
        p = self._prefill_seconds / self._prefill_counted
        q = self._score_seconds / self._score_counted
        return p / (p + q) if p + q > 0 else 0.5

    def _chunk_at(self, depth: int) -> int:
        """The most prompt tokens one prefill pass takes of a prompt already `depth`
        tokens in: --prefill-chunk at the start, fewer as each token attends to more
        keys, so that a pass deep into a long prompt costs no more than the first (each
        pass holds up every running stream for its duration). Measured on SmolLM2: 256
        tokens took 0.42 s at depth 0 and 1.8 s at depth 3,072, so a 7,300-token prompt
        (with or without prompt logprobs) held the other streams' next token for
        seconds at a time. A prompt's numbers do not depend on its chunks."""
        chunk, keys = self.config.prefill_chunk, self._keys_per_token
        return max(min(chunk, MIN_DEEP_CHUNK), int(chunk * (keys / (keys + depth))))

    def _reserve(self, a: _Active) -> bool:
        """Give `a` its pages before its first chunk (those of its prompt's full pages
        someone computed before are shared, not computed again); False when the pool
        cannot hold it yet."""
        assert self._pool is not None
        if a.pages:
            return True
        prompt = a.request.prompt_ids
        S = self.config.page_size
        # At least one token is always left to prefill (its logits are the first
        # output). Keys of the prompt's full pages: the lookup uses all but a page
        # holding the last token, the registration after prefill uses them all.
        a.page_keys = page_keys(prompt, S, len(prompt) // S)
        part = None
        if a.request.prompt_logprobs is not None:
            a.prompt_lps = [None]  # the first token has no context to score it
        shared: list[int] = []  # none where every prompt position's logits are wanted
        if a.request.prompt_logprobs is None and self.config.prefix_cache:
            shared, part = self._pool.cached_prefix(prompt, a.page_keys)
        held = shared + ([part[0]] if part else [])
        fresh = self._pool.allocate(_reserved_pages(a.request, S) - len(shared))
        if fresh is None:
            self._pool.release(held)
            if self._pool.short:
                self._memory_short(a)
            return False  # pages come back when running requests finish
        self._memory_was_short = False
        self._kv.zero_pages(fresh)
        a.pages = shared + fresh
        a.prefilled = len(shared) * S
        if part:  # its rows copied into this prompt's own page, which goes on from there
            self._kv.copy_rows(part[0], fresh[0], part[1])
            self._pool.release([part[0]])
            a.prefilled += part[1]
        a.cached = a.prefilled
        self._cached_tokens += a.cached
        a.prefill_start = time.perf_counter()
        return True

    def _memory_short(self, a: _Active) -> None:
        """`a`'s pages found no memory (`_reserve`). While requests hold pages, it waits
        for theirs; when none does, no page will come back, and it fails (503)."""
        assert self._pool is not None
        pool = self._pool
        if not self._memory_was_short:
            self._memory_was_short = True
            self._log.warning(
                "kv_memory_short",
                pages_touched=pool.touched,
                pages_total=pool.n_pages,
                available_bytes=available_memory(self.config.device)[0],
                floor_bytes=KV_MEMORY_FLOOR_BYTES,
            )
        if pool.used == 0:
            self._finish(a, "error", KV_MEMORY)

    def _prefill_pass(self, group: list[_Active], size: int | None = None) -> None:
        """One pass over the next chunk of each request of `group` (`size`: the chunk of
        a request alone, when cut shorter); those whose prompt is done get their first
        token and move on to decoding."""
        dev = self.config.device
        S = self.config.page_size
        chunks = [
            a.request.prompt_ids[a.prefilled : a.prefilled + (size or self._chunk_at(a.prefilled))]
            for a in group
        ]
        began = time.perf_counter()
        scoring = 0.0  # seconds of it spent scoring prompt tokens
        try:
            model = self._transformer
            passes = []
            for a, chunk in zip(group, chunks, strict=True):
                end = a.prefilled + len(chunk)
                passes.append((
                    torch.tensor([chunk], device=dev),
                    torch.arange(a.prefilled, end, device=dev).view(1, -1),
                    torch.tensor([a.pages[: pages_for(end, S)]], device=dev),
                ))  # fmt: skip
            xs = model.hidden_many(passes, self._kv)  # (1, T, dim) each
            if len(group) == 1:
                last = xs[0][:, -1]  # (1, dim): as `forward(last_only=True)`
            else:  # padded to a batch size whose rows the head computes as alone
                n = self._padded(len(group))
                last = torch.cat([x[:, -1] for x in xs] + [xs[0][:, -1]] * (n - len(group)))
            rows = model.logits(last)[: len(group)].float().cpu()  # (n, V)
            for a, x in zip(group, xs, strict=True):
                if a.prompt_lps is not None:
                    t = time.perf_counter()
                    self._score_prompt(a, a.prefilled, model.logits(x[0]).cpu())
                    scoring += time.perf_counter() - t
        except Exception:
            for a in group:
                self._fail(a, "prefill")
            return
        tokens = sum(len(c) for c in chunks)
        self._prefill_tokens += tokens
        self._prefill_passes += 1
        self._prefill_seconds = 0.8 * self._prefill_seconds + (
            time.perf_counter() - began - scoring
        )
        self._prefill_counted = 0.8 * self._prefill_counted + tokens
        if scoring:
            self._score_seconds = 0.8 * self._score_seconds + scoring
            self._score_counted = 0.8 * self._score_counted + tokens
        for i, (a, chunk) in enumerate(zip(group, chunks, strict=True)):
            a.prefilled += len(chunk)
            if a.prefilled < len(a.request.prompt_ids):
                continue
            self._index_pages(a, a.request.prompt_ids, a.page_keys)
            with self._stats_lock:
                self._waiting.remove(a)
            a.position = len(a.request.prompt_ids)
            a.decode_start = time.perf_counter()
            try:
                token = sample_rows(rows[i : i + 1], [a.sampler])[0]
                scored = self._logprob(a, rows[i], token)
            except Exception:
                self._fail(a, "prefill")
                continue
            with self._stats_lock:
                self._decoding.append(a)
            self._accept(a, token, scored)

    def _index_pages(self, a: _Active, tokens: Sequence[int], keys: list[bytes]) -> None:
        """Put `a`'s full pages of `tokens` (whose keys and values are final) in the
        prefix cache, `keys` their chained digests."""
        assert self._pool is not None
        if self.config.prefix_cache:
            self._pool.index(a.pages, tokens, keys)

    def _score_prompt(self, a: _Active, start: int, logits: torch.Tensor) -> None:
        """Log probabilities of the prompt tokens a chunk's (T, V) logits predict."""
        assert a.prompt_lps is not None
        assert a.request.prompt_logprobs is not None
        prompt = a.request.prompt_ids
        for i in range(logits.shape[0]):
            if start + i + 1 < len(prompt):
                token = prompt[start + i + 1]
                a.prompt_lps.append(logprobs_of(logits[i], token, a.request.prompt_logprobs))

    @staticmethod
    def _logprob(a: _Active, row: torch.Tensor, token: int) -> TokenLogprob | None:
        k = a.request.logprobs
        return None if k is None else logprobs_of(row, token, k)

    def _grow(self, rows: list[_Active]) -> list[_Active]:
        """Give each row whose next position starts a page beyond its reservation a free
        page; a row that cannot have one ends (`capacity`). Pages that requests waiting
        to prefill will take are not free to grow into."""
        S = self.config.page_size
        out = []
        for a in rows:
            if a.position < len(a.pages) * S:
                out.append(a)
                continue
            if not self._extend(a, 1):
                self._finish(a, "capacity")
                continue
            out.append(a)
        return out

    def _extend(self, a: _Active, n: int) -> bool:
        """Give `a` n more pages (zeroed) from those free that requests waiting to
        prefill are not owed; False, and none taken, when there are not so many."""
        assert self._pool is not None
        S = self.config.page_size
        owed = sum(_reserved_pages(w.request, S) for w in self._waiting if not w.pages)
        pages = self._pool.allocate(n, spare=owed)
        if pages is None:
            return False
        self._kv.zero_pages(pages)
        a.pages.extend(pages)
        return True

    def _decode_step(self) -> None:
        """One pass over every decode-ready row: rows with a draft (--spec) verify it in
        the same pass, in groups of rows whose drafts have one length (`_speculative`)."""
        rows = self._grow([a for a in self._decoding if not a.paused])
        if not rows:
            return
        self._since_score += 1
        # Drafts only in a step of at most --max-concurrency rows: the row counts up to
        # which a pass computes each row alike were measured for those (_setup_speculation).
        drafts: list[list[int]] = [[] for _ in rows]
        if self._spec != "none" and len(rows) <= self.config.max_batch:
            limits = [self._draft_limit(a) for a in rows]
            chances = [a.spec.acceptance(self._spec_prior) if a.spec else 0.0 for a in rows]
            plan = plan_drafts(chances, limits, self._row_cost)
            drafts = group_lengths([self._propose(a, k) for a, k in zip(rows, plan, strict=True)])
        plain = [a for a, d in zip(rows, drafts, strict=True) if not d]
        # Rows whose drafts have one length verify as one group.
        by_length: dict[int, list[tuple[_Active, list[int]]]] = {}
        for a, d in zip(rows, drafts, strict=True):
            if d:
                by_length.setdefault(len(d), []).append((a, d))
        drafted = [row for group in by_length.values() for row in group]
        try:
            host, spans = step_logits(
                self._transformer,
                self._kv,
                self._plain_group(plain) if plain else None,
                [self._draft_group(group) for group in by_length.values()],
            )
            tokens = (
                sample_rows(host[: len(plain)], [a.sampler for a in plain])
                if host is not None
                else []
            )
            scored = (
                [
                    self._logprob(a, host[i], t)
                    for i, (a, t) in enumerate(zip(plain, tokens, strict=True))
                ]
                if host is not None
                else []
            )
        except Exception:
            for a in rows:
                self._fail(a, "decode")
            return
        self._decode_steps += 1
        self._decode_rows += len(rows)
        now = time.perf_counter()
        if self._last_decode_end is not None:
            with self._stats_lock:
                self._pace.add(now - self._last_decode_end)
        self._last_decode_end = now
        before = self._generated
        for a, token, lp in zip(plain, tokens, scored, strict=True):
            a.position += 1
            if a.spec is not None:
                a.spec.fallback_steps += 1
            self._accept(a, token, lp)
        row_logits = [row for span in spans for row in span]  # (k + 1, V) each
        for (a, draft), logits in zip(drafted, row_logits, strict=True):
            self._verify(a, draft, logits)
        if self._spec != "none":  # what a step gives a row: for how long requests take
            self._row_tokens_ema = _ema(
                self._row_tokens_ema, (self._generated - before) / len(rows)
            )

    def _plain_group(self, rows: list[_Active]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows decoding one token each as one (B + padding, 1) group."""
        dev = self.config.device
        S = self.config.page_size
        width = max(pages_for(a.position + 1, S) for a in rows)
        table = [_page_row(a, width) for a in rows]
        tokens_in = [[a.last_token] for a in rows]
        positions = [[a.position] for a in rows]
        # Padding rows (see _invariance): token 0 at position 0, writing the scratch page.
        pad = self._padded(len(rows)) - len(rows)
        table += [[self._kv.scratch_page] + [0] * (width - 1)] * pad
        tokens_in += [[0]] * pad
        positions += [[0]] * pad
        return (
            torch.tensor(tokens_in, device=dev),  # (B + pad, 1)
            torch.tensor(positions, device=dev),  # (B + pad, 1)
            torch.tensor(table, device=dev),  # (B + pad, width)
        )

    def _draft_group(
        self, rows: list[tuple[_Active, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows and their drafts (of one length k) as one (n, k + 1) group: each row's
        last token, then its draft."""
        dev = self.config.device
        S = self.config.page_size
        T = len(rows[0][1]) + 1
        width = max(pages_for(a.position + T, S) for a, _ in rows)
        return (
            torch.tensor([[a.last_token, *d] for a, d in rows], device=dev),
            torch.tensor([list(range(a.position, a.position + T)) for a, _ in rows], device=dev),
            torch.tensor([_page_row(a, width) for a, _ in rows], device=dev),
        )

    def _draft_limit(self, a: _Active) -> int:
        """The most tokens `a` may draft: within its budget (the round's last token
        included) and the context."""
        return min(
            a.spec.window if a.spec is not None else 0,
            a.request.max_new_tokens - a.generated - 1,
            self.max_context - 1 - a.position,
        )

    def _propose(self, a: _Active, planned: int) -> list[int]:
        """`a`'s draft for this step, at most `planned` tokens ([]: a plain step), with
        pages for every drafted position: taken from the free pages that waiting
        requests are not owed, else the draft is cut to the row's own pages."""
        if a.spec is None or planned <= 0:
            return []
        S = self.config.page_size
        draft = a.spec.propose(planned, a.sampler.constraint, a.output_ids)
        need = pages_for(a.position + len(draft) + 1, S) - len(a.pages)
        if draft and need > 0 and not self._extend(a, need):
            return draft[: len(a.pages) * S - a.position - 1]
        return draft

    def _verify(self, a: _Active, draft: list[int], logits: torch.Tensor) -> None:
        """Sample `a`'s (k + 1, V) logits a position at a time, as plain steps would, and
        keep tokens up to the first that differs from the draft (or that ends the
        request). Then the keys and values rejected positions wrote are cleared and
        pages no longer needed given back: the row is where plain steps leave it."""
        assert a.spec is not None
        start = a.position
        kept = 0
        alive = True
        a.spec.begin(len(draft))
        self._spec_rounds += 1
        self._drafted += len(draft)
        for j in range(len(draft) + 1):
            try:
                token = sample_rows(logits[j : j + 1], [a.sampler])[0]
                scored = self._logprob(a, logits[j], token)
            except Exception:
                self._fail(a, "decode")
                alive = False
                break
            a.position = start + j + 1
            hit = j < len(draft) and token == draft[j]
            if hit:
                kept += 1
                self._accepted += 1
                a.spec.keep(j)
            alive = self._accept(a, token, scored, deliver=False)
            if not alive or not hit:
                break
        a.spec.adapt(len(draft), kept)
        judged = kept + (1 if kept < len(draft) else 0)
        self._spec_prior = 0.95 * self._spec_prior + 0.05 * kept / judged
        if not alive:
            return  # finished: its pages went back whole
        S = self.config.page_size
        rejected = range(a.position, start + len(draft) + 1)
        self._kv.clear_slots([a.pages[p // S] for p in rejected], [p % S for p in rejected])
        keep = max(_reserved_pages(a.request, S), pages_for(a.position, S))
        if len(a.pages) > keep:
            assert self._pool is not None
            self._pool.release(a.pages[keep:])
            del a.pages[keep:]
        self._deliver(a, a.text.take(final=False))

    def _accept(
        self, a: _Active, token: int, scored: TokenLogprob | None = None, *, deliver: bool = True
    ) -> bool:
        """Record a sampled token for a decoding request and apply the stop rules; False
        when they ended it. `deliver`: send its text now (else the caller does, once the
        step's tokens of the row are all in)."""
        try:
            req = a.request
            a.generated += 1
            self._generated += 1
            a.last_token = token
            a.pending_ids.append(token)
            a.output_ids.append(token)
            a.sampler.observe(token)
            assert self.model is not None
            if token in self.model.tokenizer.eos_ids and not req.ignore_eos:
                self._finish(a, "eos")  # its logprob is not reported: it is no text
                return False
            if scored is not None:
                a.pending_lps.append(scored)
            a.text.push(token)
            if a.text.stopped_at is not None or a.sampler.grammar_done:
                self._finish(a, "stop")  # a stop string, or the grammar is complete
            elif a.generated >= req.max_new_tokens:
                self._finish(a, "length")
            elif a.position + 1 > self.max_context:
                self._finish(a, "context")
            else:
                if deliver:
                    self._deliver(a, a.text.take(final=False))
                return True
            return False
        except GrammarLimitReached as exc:
            self._log.info(
                "grammar_limit_reached",
                request_id=a.handle.request_id,
                error=str(exc).split("\n", 1)[0][:200],
            )
            self._finish(a, "error", GRAMMAR_LIMIT)
        except Exception:
            self._fail(a, "decode")
        return False

    def _deliver(self, a: _Active, text: str) -> None:
        """The step's TokenDelta of `a`: its pending tokens and the text they complete."""
        first = not a.delivered
        a.delivered = True
        delta = TokenDelta(
            tuple(a.pending_ids),
            text,
            a.cached if first else None,
            tuple(a.pending_lps) if a.request.logprobs is not None else None,
            tuple(a.prompt_lps) if first and a.prompt_lps is not None else None,
        )
        self._events.append((a.handle, delta))
        a.pending_ids = []
        a.pending_lps = []

    def _finish(self, a: _Active, reason: FinishReason, error: str | None = None) -> None:
        if self._by_id.pop(a.handle.id, None) is None:
            return
        with self._stats_lock:
            if a in self._decoding:
                self._decoding.remove(a)
            elif a in self._waiting:
                self._waiting.remove(a)
            if a.pages:
                assert self._pool is not None
                if reason not in ("cancelled", "error") and a.position:
                    # Its output's full pages too (a next turn of the conversation
                    # starts with them): the tokens whose keys and values were written.
                    seen = (*a.request.prompt_ids, *a.output_ids)[: a.position]
                    S = self.config.page_size
                    keys = page_keys(seen, S, len(seen) // S, known=a.page_keys)
                    self._index_pages(a, seen, keys)
                self._pool.release(a.pages)
                a.pages = []
        if reason not in ("cancelled", "error"):
            text = a.text.take(final=True)
            if a.pending_ids or text:
                self._deliver(a, text)
        a.pending_ids = []
        now = time.perf_counter()
        start = a.prefill_start or now
        decode_start = a.decode_start or now
        timings = EngineTimings(
            wait_s=start - a.submitted,
            prefill_s=decode_start - start,
            decode_s=now - decode_start,
        )
        finish = Finish(
            reason=reason,
            usage=Usage(len(a.request.prompt_ids), a.generated, a.cached),
            timings=timings,
            seed=a.sampler.seed if not a.request.sampling.greedy else None,
            stop_string=a.text.stop_string if reason == "stop" else None,
            error=error,
            speculative=a.spec.counts(self._spec) if a.spec is not None else None,
        )
        self._events.append((a.handle, finish))

    def _fail(self, a: _Active, stage: str) -> None:
        self._log.error(
            "engine_request_failed",
            request_id=a.handle.request_id,
            stage=stage,
            exception=traceback.format_exc(),
        )
        self._finish(a, "error", f"the engine failed during {stage}")

    def _fail_all(self, error: str | None) -> None:
        for a in list(self._by_id.values()):
            self._finish(a, "error" if error else "cancelled", error)

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._sink.deliver(events)


def _page_row(a: _Active, width: int) -> list[int]:
    """`a`'s first `width` pages, filled up with the always-zero page 0."""
    return a.pages[:width] + [0] * (width - min(width, len(a.pages)))


def _reserved_pages(request: GenerationRequest, page_size: int) -> int:
    """The pages a request holds from the start of its prefill (`reserved_pages`)."""
    return reserved_pages(len(request.prompt_ids), request.reserved_tokens, page_size)


class StepPace:
    """The decode pace: the median of the last PACE_STEPS intervals between decode
    steps (0.0 until one is measured), so that one slow step does not move it."""

    def __init__(self) -> None:
        self._intervals: deque[float] = deque(maxlen=PACE_STEPS)

    def add(self, seconds: float) -> None:
        self._intervals.append(seconds)

    def seconds(self) -> float:
        return statistics.median(self._intervals) if self._intervals else 0.0


def _ema(previous: float, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average; the first sample is taken as it is."""
    return sample if previous == 0.0 else (1 - weight) * previous + weight * sample


def _gib(n: int) -> str:
    """A size for people: GiB to two places, or MiB under one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
