"""The engine: one thread owns torch, the model, the KV cache and every sampler.

`submit`, `pause` and `cancel` are thread-safe and never block: they put a command on
a queue that the engine thread drains at each step boundary. Start-up decisions are
made once (`_startup`: the pool's size, the batch sizes, prefilling together,
speculation) and read from the plan. Each step then:

1. prefills: chunks of as many waiting prompts, in order, as fit within
   --prefill-chunk tokens (a chunk shrinks as it goes deeper into a long prompt), each
   request's KV pages reserved before its first chunk (its prompt's full pages shared
   from the prefix cache where they were computed before); run as one pass where the
   start-up measured that rows are computed the same in any number of rows, else one
   pass each; a prompt whose tokens are scored runs alone, and at most once every
   SCORE_EVERY decode steps while others decode; while rows decode, the chunks run
   together join the decode step's pass where they fit in its rows (`_mixes`);
2. sends the prompts' first tokens;
3. decodes every running row that is not paused, as one batch padded to a batch size
   whose rows are computed as alone, with the prompt chunks that join it; with --spec,
   rows with a draft verify it in the same pass and keep the tokens a plain step would
   have sampled.

Each request's row (`_sequence.Row`) applies its own stop rules and builds its events;
the engine moves rows between the queues, gives and takes their pages, and sends a
step's events in one `EventSink.deliver` call. A request ends with exactly one
`Finish` event.
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

import attrs
import structlog
import torch
from structlog.typing import FilteringBoundLogger

from ninfer.engine._contract import (
    GRAMMAR_LIMIT,
    KV_MEMORY,
    KV_MEMORY_FLOOR_BYTES,
    EngineConfig,
    EngineStatistics,
    Event,
    EventSink,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    ServedModel,
    TokenLogprob,
)
from ninfer.engine._errors import EngineStopped
from ninfer.engine._grammar import GrammarLimitReached, GrammarTable
from ninfer.engine._kvpool import KVPages, PagePool, page_keys, pages_for, reserve_prompt
from ninfer.engine._loader import LoadedModel, trim_heap
from ninfer.engine._memory import available_memory
from ninfer.engine._model import Transformer
from ninfer.engine._sampling import sample_rows
from ninfer.engine._sequence import Row, check_request, draft_group, plain_group
from ninfer.engine._speculative import by_length, group_lengths, plan_drafts, step_logits
from ninfer.engine._startup import StartupPlan, served_model, start_up

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
# A prefill chunk deep into a long prompt is never cut below this many tokens.
MIN_DEEP_CHUNK = 16
# A prompt whose tokens are scored (prompt logprobs, echo) is background work: while
# other requests decode, its passes come at most once every this many decode steps, so
# that most of their tokens come at the pace they had before (docs/engine.md).
SCORE_EVERY = 3
# While other requests decode, a prefill pass is cut to take about this long (by the
# measured seconds a cost unit: `Counters.unit_rate`), so that a stream's token waits
# at most about this for a long prompt beside it. Chosen by measurement
# (benchmarks/prefill.py --gaps; docs/benchmarks.md, "Long prompts").
STREAM_PASS_S = 0.1
# The same cut before any prefill pass was timed: tokens at depth 0 (on SmolLM2 on 2
# cores, 64 tokens take ~0.1 s).
COLD_STREAM_CHUNK = 64


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


class StepPace:
    """The decode pace: the median of the last PACE_STEPS intervals between decode
    steps (0.0 until one is measured), so that one slow step does not move it."""

    def __init__(self) -> None:
        self._intervals: deque[float] = deque(maxlen=PACE_STEPS)

    def add(self, seconds: float) -> None:
        self._intervals.append(seconds)

    def seconds(self) -> float:
        return statistics.median(self._intervals) if self._intervals else 0.0


@attrs.define
class Counters:
    """What the engine has done (totals) and its measured rates (decaying sums),
    written by the engine thread and read by `statistics` under its lock."""

    steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    prefill_passes: int = 0
    cached_tokens: int = 0
    generated: int = 0
    spec_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    kernel_solo_calls: int = 0  # from the native kernels' pool, read every 64 steps
    # tokens a decode step gives a row (1 without speculation; a moving average)
    row_tokens: float = 1.0
    # prefill seconds and tokens, decaying sums: their ratio weighs each chunk by its
    # tokens, so that the fixed cost of a tiny prompt does not pass for a rate
    prefill_seconds: float = 0.0
    prefill_counted: float = 0.0
    # scoring prompt tokens (the head over a chunk's rows, their logprobs): likewise
    score_seconds: float = 0.0
    score_counted: float = 0.0
    # prefill seconds and cost units (a token at depth d costs 1 + d / keys_per_token:
    # `Engine._chunk_at`), decaying sums: what a pass of a given cost takes now
    unit_seconds: float = 0.0
    unit_counted: float = 0.0
    # the same of the passes taken while other requests decoded, which the time budget
    # sizes (`unit_rate`): smaller passes than a prompt's alone, each paying a pass's
    # fixed cost, beside decode steps and the event loop's work. Sized by the rate of
    # every pass, the first passes of Gemma 3 270M's prompt beside a stream took 150-240
    # ms of a 0.1 s budget, the rate learned from large passes alone.
    beside_seconds: float = 0.0
    beside_counted: float = 0.0
    pace: StepPace = attrs.field(factory=StepPace)  # between decode steps
    # When the engine last made progress, and how long the recent steps took (what a
    # stall is judged against).
    last_progress: float = attrs.field(factory=time.monotonic)
    recent_steps: deque[float] = attrs.field(factory=lambda: deque(maxlen=RECENT_STEPS))

    def add_prefill(
        self, tokens: int, seconds: float, scoring: float, units: float, beside: bool = False
    ) -> None:
        """A prefill pass of `tokens` (`units` of cost) that took `seconds`, `scoring` of
        them scoring; `beside`: while other requests decoded."""
        self.prefill_tokens += tokens
        self.prefill_passes += 1
        self.prefill_seconds = 0.8 * self.prefill_seconds + (seconds - scoring)
        self.prefill_counted = 0.8 * self.prefill_counted + tokens
        self.unit_seconds = 0.5 * self.unit_seconds + (seconds - scoring)
        self.unit_counted = 0.5 * self.unit_counted + units
        if beside:
            self.beside_seconds = 0.5 * self.beside_seconds + (seconds - scoring)
            self.beside_counted = 0.5 * self.beside_counted + units
        if scoring:
            self.score_seconds = 0.8 * self.score_seconds + scoring
            self.score_counted = 0.8 * self.score_counted + tokens

    def prefill_rate(self) -> float:
        """Seconds a prompt token, once enough were measured (else 0.0)."""
        if self.prefill_counted < PREFILL_RATE_MIN_TOKENS:
            return 0.0
        return self.prefill_seconds / self.prefill_counted

    def unit_rate(self) -> float:
        """Seconds a cost unit of prefill beside decoding requests, as the recent such
        passes took; before PREFILL_RATE_MIN_TOKENS of those, as any recent passes took
        (0.0 until one pass of PREFILL_RATE_MIN_TOKENS was measured)."""
        if self.beside_counted >= PREFILL_RATE_MIN_TOKENS:
            return self.beside_seconds / self.beside_counted
        if self.unit_counted < PREFILL_RATE_MIN_TOKENS:
            return 0.0
        return self.unit_seconds / self.unit_counted

    def plain_share(self) -> float:
        """The share of a scoring pass's tokens that costs what a plain pass of the same
        tokens does: prefill seconds a token / (those + scoring seconds a token), as
        measured (a half until both are)."""
        if self.prefill_counted < PREFILL_RATE_MIN_TOKENS or self.score_counted <= 0:
            return 0.5
        p = self.prefill_seconds / self.prefill_counted
        q = self.score_seconds / self.score_counted
        return p / (p + q) if p + q > 0 else 0.5

    def statistics(
        self,
        state: str,
        waiting: Sequence[Row],
        decoding: Sequence[Row],
        pool: PagePool | None,
        plan: StartupPlan | None,
    ) -> EngineStatistics:
        """The engine's statistics from these counters and its queues (under its lock)."""
        prefilling = 1 if waiting and waiting[0].pages else 0
        return EngineStatistics(
            state=state,
            waiting=len(waiting) - prefilling,
            prefilling=prefilling,
            decoding=len(decoding),
            pages_total=pool.n_pages if pool else 0,
            pages_used=pool.used if pool else 0,
            pages_free=pool.free if pool else 0,
            steps=self.steps,
            last_progress=self.last_progress,
            slowest_recent_step=max(self.recent_steps, default=0.0),
            busy=bool(waiting) or any(not a.paused for a in decoding),
            batch_invariant=plan.batch_invariant if plan else False,
            batch_sizes=plan.batch_sizes if plan else (1,),
            decode_steps=self.decode_steps,
            decode_rows=self.decode_rows,
            prefill_tokens=self.prefill_tokens,
            prefill_passes=self.prefill_passes,
            cached_prompt_tokens=self.cached_tokens,
            pages_cached=pool.cached if pool else 0,
            generated_tokens=self.generated,
            decode_step_seconds=self.pace.seconds(),
            decode_tokens_per_row=self.row_tokens,
            prefill_seconds_per_token=self.prefill_rate(),
            spec_rounds=self.spec_rounds,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            kernel_solo_calls=self.kernel_solo_calls,
        )


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
        # Set by `run` before it is ready (start_up's), fixed after.
        self.model: LoadedModel | None = None
        self.plan: StartupPlan | None = None
        self._pool: PagePool | None = None
        self._kv: KVPages | None = None
        self._grammars: GrammarTable | None = None
        self._load_seconds = 0.0  # from reading the file to ready
        self._waiting: deque[Row] = deque()
        self._decoding: list[Row] = []
        self._by_id: dict[int, Row] = {}
        self._events: list[tuple[RequestHandle, Event]] = []
        self._counters = Counters()
        self._since_score = SCORE_EVERY  # decode steps since the last scoring pass
        # Whether reservations find no memory for their pages (said once, until they do).
        self._memory_was_short = False
        self._last_decode_end: float | None = None
        self._stats_lock = threading.Lock()
        # The recent chance that a drafted token is kept, over every row (a new row's prior).
        self._spec_prior = 0.5

    # ---- thread-safe API -------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestInvalid when the request can never run here."""
        if self.model is None or self._pool is None:
            raise EngineStopped("the model is not loaded")
        check_request(
            request,
            vocab=self.model.identity.vocab_size,
            max_context=self._p.max_context,
            kv_pages=self._pool.n_pages,
            page_size=self.config.page_size,
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
        assert self._grammars is not None
        grammars = self._grammars.compile  # on the caller's thread (a frontend's worker)
        return served_model(self.model, self._p, self.config, self._load_seconds, grammars)

    def statistics(self) -> EngineStatistics:
        with self._stats_lock:
            return self._counters.statistics(
                self._state, self._waiting, self._decoding, self._pool, self.plan
            )

    # ---- the engine thread ------------------------------------------------------------

    def run(self, on_ready: Callable[[ServedModel], None] = lambda _m: None) -> None:
        """Load, start up (`_startup`) and serve until `shutdown`. Runs on the engine
        thread."""
        try:
            with torch.inference_mode():
                self._state = "loading"
                began = time.perf_counter()
                # (no name kept for what the loader returns: the file's map goes with it)
                started = start_up(self._loader(), self.config, self._log)
                self.model, self.plan = started.model, started.plan
                self._pool, self._kv = started.pool, started.kv
                self._grammars = GrammarTable(
                    started.model.tokenizer, started.model.identity.vocab_size
                )
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

    # The parts start-up gave, for the engine thread (once `run` set them).

    @property
    def _transformer(self) -> Transformer:
        assert self.model is not None
        return self.model.transformer

    @property
    def _p(self) -> StartupPlan:
        assert self.plan is not None
        return self.plan

    @property
    def _pages(self) -> PagePool:
        assert self._pool is not None
        return self._pool

    @property
    def _cache(self) -> KVPages:
        assert self._kv is not None
        return self._kv

    def _loop(self) -> None:
        # Events go to the request tasks as the next native pass starts (`before_pass`),
        # not as soon as a step made them: the event loop's work on them is Python, and
        # woken between this thread's small torch calls (each gives the GIL up) it held
        # the GIL while this thread waited for it back, ~0.5 ms a token of one stream;
        # woken as the pass starts, it runs while this thread is in native code, which
        # holds no GIL. Without the native layers, after each step as before. Nothing
        # waits for a pass that is not coming, nor for other work first: an idle engine,
        # a step without a pass, commands to apply and prompts to set up deliver at once.
        native = self._transformer.native
        if native is not None:
            native.before_pass = self._flush
        try:
            while True:
                idle = not self._waiting and all(a.paused for a in self._decoding)
                if idle:
                    self._last_decode_end = None  # time waiting for work is no step's
                    self._flush()
                if not self._drain_commands(block=idle):
                    return
                self._step()
                if not self._flush_at_pass:
                    self._flush()
        finally:
            if native is not None:
                native.before_pass = None

    @property
    def _flush_at_pass(self) -> bool:
        """Whether the next native pass delivers the pending events (`_loop`)."""
        native = self._transformer.native
        return native is not None and native.before_pass is not None

    def _drain_commands(self, *, block: bool) -> bool:
        """Apply queued commands; False on shutdown. Blocks for one when idle."""
        while True:
            try:
                if block:
                    command = self._commands.get()
                    # Progress is measured while there is work: the wait for it is none
                    # of the engine's (else the first step after a long idle looks
                    # stalled, and /ready refuses).
                    self._counters.last_progress = time.monotonic()
                    block = False
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return True
            # What was made goes out before a command is applied: admitting a request
            # (its sampler, its grammar) holds no made token back.
            self._flush()
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
        assert self._grammars is not None
        row = Row.create(
            handle,
            request,
            submitted,
            self.model,
            native_top_p=self._p.native_top_p,
            native_top_k=self._p.native_top_k,
            native_sample=self._p.native_sample,
            draft_tokens=self.config.draft_tokens if self._p.speculative != "none" else 0,
        )
        self._by_id[handle.id] = row
        with self._stats_lock:
            self._waiting.append(row)
        grammar = request.sampling.grammar
        if grammar is not None:
            try:
                row.sampler.constraint = self._grammars.constraint(grammar)
            except Exception:
                self._fail(row, "grammar")

    def _step(self) -> None:
        if self._waiting:  # a prompt's setting up (pages, cached prefixes) comes first
            self._flush()
        group, sizes = self._prefill()
        # Beside running streams the prompts' chunks join their decode step's pass (one
        # pass where there were two: a stream's token waits for the prompt's chunk, not
        # for it and then a step); else they run first, alone.
        if group and not self._mixes(sizes):
            self._prefill_pass(group, sizes)
            group, sizes = [], []
        # A prompt's first token goes out before the decode step below, not after it
        # (which would hold it back a whole step: 17 ms of SmolLM2's time to first token):
        # as its pass starts (`_loop`), or now.
        if self._streaming():
            if not self._flush_at_pass:
                self._flush()
            self._decode_step(group, sizes)
        else:
            self._flush()
            self._last_decode_end = None  # the next step's interval starts anew
        c = self._counters
        if self._transformer.native is not None and c.steps % 64 == 0:
            c.kernel_solo_calls = int(torch.ops.ninfer.pool_stats()[2])
        with self._stats_lock:
            c.steps += 1
            now = time.monotonic()
            self._counters.recent_steps.append(now - self._counters.last_progress)
            self._counters.last_progress = now

    def _streaming(self) -> bool:
        """Some running request takes part in decode steps (one paused for its slow
        reader does not)."""
        return any(not a.paused for a in self._decoding)

    # ---- prefill: waiting prompts, their pages reserved --------------------------------

    def _prefill(self) -> tuple[list[Row], list[int]]:
        """Prefill chunks up to --prefill-chunk tokens in all, across as many waiting
        requests as fit whole, in order: a burst of short prompts starts decoding
        together instead of one per decode step. Every row is computed on its own, so
        a prompt's numbers never depend on what else was waiting, nor on what was cached
        (docs/engine.md, "Prefix cache"). When the model's matmuls compute a row the same
        in any number of rows (measured at start-up and by the self-check: the int4
        kernel and oneDNN's float32 matmul do), the chunks run as one pass, which pays a
        pass's fixed cost once; else one pass each. Passes that run alone (a scored
        prompt's, one past the rows a pass may have) run here; returns the group that
        runs together and its chunks' sizes, for `_step` to run (with the decode step's
        rows where they fit: `_mixes`)."""
        decoding = self._streaming()
        chunk = float(self.config.prefill_chunk)  # in tokens at depth 0 (see _chunk_at)
        if decoding:  # cut to the time budget (before any pass was measured: a guess)
            unit = self._counters.unit_rate()
            budget_units = STREAM_PASS_S / unit if unit > 0 else float(COLD_STREAM_CHUNK)
            chunk = min(chunk, max(float(MIN_DEEP_CHUNK), budget_units))
        rows = 0  # of the group's pass
        if decoding and self._can_mix():  # the decode step's rows share it (`_mixes`)
            rows = self._p.padded(self._stream_rows())
            room = self._p.together_rows - rows
            if room >= MIN_DEEP_CHUNK:
                chunk = min(chunk, float(room))
        budget = chunk
        group: list[Row] = []
        sizes: list[int] = []  # the group's chunks
        for a in list(self._waiting):
            scoring = a.request.prompt_logprobs is not None
            embedding = a.request.embed is not None
            if (scoring or embedding) and decoding and self._since_score < SCORE_EVERY:
                continue  # its next pass waits for the streams' next steps
            left = len(a.request.prompt_ids) - a.prefilled
            size = min(self._chunk_at(a.prefilled, chunk), left)
            if scoring:  # a pass with its scoring costs what a plain pass does
                share = self._counters.plain_share()
                size = max(min(MIN_DEEP_CHUNK, size), int(size * share))
            cost = self._p.prefill_units(size, a.prefilled)
            first = budget == chunk  # (its chunk always goes)
            if (cost > budget + 1e-9 and not first) or not self._reserve(a):
                break
            budget -= cost
            if not scoring and rows + size <= self._p.together_rows:
                group.append(a)
                sizes.append(size)
                rows += size
            else:  # alone, as every prompt row's logits (prompt logprobs) need it
                self._prefill_pass([a], [size])
                if scoring or embedding:
                    self._since_score = 0
                    if a.prefilled >= len(a.request.prompt_ids):
                        trim_heap()  # its passes' logits: hundreds of MB, given back
            if size < left:
                break  # its next chunk comes before anyone behind it
        if any(a.request.embed is not None for a in group):
            self._since_score = 0  # the group holds an embedding request's chunk
        return group, sizes

    def _stream_rows(self) -> int:
        """The rows the next decode step computes (those not paused)."""
        return sum(not a.paused for a in self._decoding)

    def _can_mix(self) -> bool:
        """Whether prompts' chunks may share a decode step's pass: where prompts are
        prefilled together (the layers' matrices compute a row the same in any number
        of rows up to `together_rows`, measured), and without drafts to verify (whose
        rows a step plans after choosing its prompts)."""
        return self._p.together_rows > 0 and self._p.speculative == "none"

    def _mixes(self, sizes: list[int]) -> bool:
        """Whether chunks of `sizes` tokens share the decode step's pass (`_can_mix`):
        while rows decode, and all of them fit in the rows a pass may have."""
        streams = self._stream_rows()
        return (
            streams > 0
            and self._can_mix()
            and self._p.padded(streams) + sum(sizes) <= self._p.together_rows
        )

    def _chunk_at(self, depth: int, chunk: float | None = None) -> int:
        """The most prompt tokens one prefill pass takes of a prompt already `depth`
        tokens in: `chunk` (--prefill-chunk, or fewer while others decode: `_prefill`)
        at the start, fewer as each token attends to more
        keys, so that a pass deep into a long prompt costs no more than the first (each
        pass holds up every running stream for its duration). Measured on SmolLM2: 256
        tokens took 0.42 s at depth 0 and 1.8 s at depth 3,072, so a 7,300-token prompt
        (with or without prompt logprobs) held the other streams' next token for
        seconds at a time. A prompt's numbers do not depend on its chunks."""
        chunk = self.config.prefill_chunk if chunk is None else chunk
        keys = self._p.keys_per_token
        return max(
            int(min(chunk, MIN_DEEP_CHUNK)), int(chunk * (keys / (keys + self._p.attended(depth))))
        )

    def _reserve(self, a: Row) -> bool:
        """Give `a` its pages before its first chunk (those of its prompt's full pages
        someone computed before are shared, not computed again); False when the pool
        cannot hold it yet."""
        if a.pages:
            return True
        pool, kv = self._pages, self._cache
        prompt = a.request.prompt_ids
        S = self.config.page_size
        # At least one token is always left to prefill (its logits are the first
        # output). Keys of the prompt's full pages: the lookup uses all but a page
        # holding the last token, the registration after prefill uses them all.
        a.page_keys = page_keys(prompt, S, len(prompt) // S)
        if a.request.prompt_logprobs is not None:
            a.prompt_lps = [None]  # the first token has no context to score it
        # None shared where every prompt position's logits (or states) are wanted.
        share = (
            a.request.prompt_logprobs is None
            and a.request.embed is None
            and self.config.prefix_cache
        )
        # Its fresh pages are zeroed pass by pass (`_zero_ahead`), not all now: an 8k
        # prompt's 500 pages are ~150-180 MB of stores (26 ms on Gemma 3 270M), which
        # held a stream beside it for the prompt's first pass.
        got = reserve_prompt(pool, kv, prompt, a.page_keys, a.reserved_pages(S), share=share)
        if got is None:
            if pool.short:
                self._memory_short(a)
            return False  # pages come back when running requests finish
        self._memory_was_short = False
        a.pages, a.prefilled = got
        a.cached = a.prefilled
        # the shared pages, and the fresh page a cached page's rows were copied into
        a.zeroed_to = pages_for(a.prefilled, S)
        self._counters.cached_tokens += a.cached
        a.prefill_start = time.perf_counter()
        if a.request.progress:  # its 0% (or the cached share): the prompt has begun
            self._events.append((a.handle, a.progress()))
        return True

    def _zero_ahead(self, a: Row, end: int) -> None:
        """Zero `a`'s pages a pass up to prompt position `end` writes that are not zeroed
        yet; with its prompt's last chunk, every page left (its output's). A page is
        zeroed before anything is written to it or read from it, as when all were
        zeroed at once."""
        S = self.config.page_size
        upto = len(a.pages) if end >= len(a.request.prompt_ids) else pages_for(end, S)
        if upto > a.zeroed_to:
            self._cache.zero_pages(a.pages[a.zeroed_to : upto])
            a.zeroed_to = upto

    def _memory_short(self, a: Row) -> None:
        """`a`'s pages found no memory (`_reserve`). While requests hold pages, it waits
        for theirs; when none does, no page will come back, and it fails (503)."""
        pool = self._pages
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

    def _prefill_pass(self, group: list[Row], sizes: list[int]) -> None:
        """One pass over the next chunk of each request of `group` (of `sizes` tokens,
        as `_prefill` chose them); those whose prompt is done get their first token and
        move on to decoding."""
        chunks = self._chunks(group, sizes)
        began = time.perf_counter()
        beside = self._streaming()  # a pass the budget sized
        try:
            xs = self._transformer.hidden_many(self._chunk_groups(group, chunks), self._cache)
            rows, scoring = self._prompt_heads(group, xs)
        except Exception:
            for a in group:
                self._fail(a, "prefill")
            return
        self._prefilled(group, chunks, rows, time.perf_counter() - began, scoring, beside)

    def _chunks(self, group: list[Row], sizes: list[int]) -> list[Sequence[int]]:
        """Each request's next prompt chunk of its size, its pages up to it zeroed."""
        chunks: list[Sequence[int]] = [
            a.request.prompt_ids[a.prefilled : a.prefilled + size]
            for a, size in zip(group, sizes, strict=True)
        ]
        for a, c in zip(group, chunks, strict=True):
            self._zero_ahead(a, a.prefilled + len(c))
        return chunks

    def _chunk_groups(
        self, group: list[Row], chunks: list[Sequence[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        S, dev = self.config.page_size, self.config.device
        return [a.chunk_group(c, S, dev) for a, c in zip(group, chunks, strict=True)]

    def _prompt_heads(self, group: list[Row], xs: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
        """What a pass's prompt chunks (hidden states `xs`, (1, T, dim) each) give: the
        logits of the last position of each that samples (an embedding request's states
        are its answer; it keeps them), and each scored prompt's logprobs. Returns those
        logits (rows, V) and the seconds spent scoring."""
        model = self._transformer
        # The head for the rows that sample: padded to a batch size whose rows it
        # computes as alone.
        heads = [x[:, -1] for a, x in zip(group, xs, strict=True) if a.request.embed is None]
        rows = torch.empty(0)
        if len(heads) == 1:
            rows = model.logits(heads[0]).float().cpu()  # as `forward(last_only=True)`
        elif heads:
            n = self._p.padded(len(heads))
            last = torch.cat(heads + [heads[0]] * (n - len(heads)))
            rows = model.logits(last)[: len(heads)].float().cpu()  # (n, V)
        scoring = 0.0
        for a, x in zip(group, xs, strict=True):
            if a.request.embed is not None:
                a.keep_states(a.prefilled, model.final_norm(x[0]))
            if a.prompt_lps is not None:
                t = time.perf_counter()
                a.score_prompt(a.prefilled, model.logits(x[0]).cpu())
                scoring += time.perf_counter() - t
        return rows, scoring

    def _prefilled(
        self,
        group: list[Row],
        chunks: list[Sequence[int]],
        rows: torch.Tensor,
        seconds: float,
        scoring: float,
        beside: bool,
    ) -> None:
        """`group`'s chunks were computed in `seconds` (`rows`: `_prompt_heads`); those
        whose prompt is done sample their first token and move on to decoding."""
        tokens = sum(len(c) for c in chunks)
        units = sum(
            self._p.prefill_units(len(c), a.prefilled) for a, c in zip(group, chunks, strict=True)
        )
        self._counters.add_prefill(tokens, seconds, scoring, units, beside)
        i = -1  # the row's place in `rows` (the rows that sample)
        for a, chunk in zip(group, chunks, strict=True):
            i += a.request.embed is None
            a.prefilled += len(chunk)
            if a.request.progress:
                self._events.append((a.handle, a.progress()))
            if a.prefilled < len(a.request.prompt_ids):
                continue
            if self.config.prefix_cache:  # its prompt's full pages, final now
                self._pages.index(a.pages, a.request.prompt_ids, a.page_keys)
            if a.request.embed is not None:  # done: its vector, and its pages free now
                try:
                    a.embedded = a.embedding()
                except Exception:
                    self._fail(a, "embedding")
                    continue
                self._finish(a, "embedded")
                continue
            with self._stats_lock:
                self._waiting.remove(a)
            a.position = len(a.request.prompt_ids)
            a.decode_start = time.perf_counter()
            try:
                token = sample_rows(rows[i : i + 1], [a.sampler])[0]
                scored = a.logprob(rows[i], token)
            except Exception:
                self._fail(a, "prefill")
                continue
            with self._stats_lock:
                self._decoding.append(a)
            self._accept(a, token, scored)

    # ---- decode: every running row, one exact batch ------------------------------------

    def _grow(self, rows: list[Row]) -> list[Row]:
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

    def _extend(self, a: Row, n: int) -> bool:
        """Give `a` n more pages (zeroed) from those free that requests waiting to
        prefill are not owed; False, and none taken, when there are not so many."""
        S = self.config.page_size
        owed = sum(w.reserved_pages(S) for w in self._waiting if not w.pages)
        pages = self._pages.allocate(n, spare=owed)
        if pages is None:
            return False
        self._cache.zero_pages(pages)
        a.pages.extend(pages)
        return True

    def _decode_step(
        self, prompts: list[Row] | None = None, sizes: list[int] | None = None
    ) -> None:
        """One pass over every decode-ready row: rows with a draft (--spec) verify it in
        the same pass, in groups of rows whose drafts have one length (`_speculative`);
        the chunks of `sizes` tokens of `prompts` too (`_mixes`)."""
        rows = self._grow([a for a in self._decoding if not a.paused])
        if prompts and sizes:
            if rows:
                self._mixed_step(rows, prompts, sizes)
                return
            self._prefill_pass(prompts, sizes)  # every row ended (out of pages): alone
        if not rows:
            self._flush()  # no pass follows
            return
        self._since_score += 1
        c = self._counters
        S, dev = self.config.page_size, self.config.device
        # Drafts only in a step of at most --max-concurrency rows: the row counts up to
        # which a pass computes each row alike were measured for those (_startup).
        drafts: list[list[int]] = [[] for _ in rows]
        if self._p.speculative != "none" and len(rows) <= self.config.max_batch:
            limits = [a.draft_limit(self._p.max_context) for a in rows]
            chances = [a.spec.acceptance(self._spec_prior) if a.spec else 0.0 for a in rows]
            plan = plan_drafts(chances, limits, self._p.row_cost)
            drafts = group_lengths([self._propose(a, k) for a, k in zip(rows, plan, strict=True)])
        plain = [a for a, d in zip(rows, drafts, strict=True) if not d]
        groups = by_length(rows, drafts)  # rows whose drafts have one length verify together
        drafted = [row for group in groups for row in group]
        try:
            padded, scratch = self._p.padded(len(plain)), self._cache.scratch_page
            host, spans = step_logits(
                self._transformer,
                self._cache,
                plain_group(plain, S, dev, padded, scratch) if plain else None,
                [draft_group(group, S, dev) for group in groups],
            )
            tokens: list[int] = []
            scored: list[TokenLogprob | None] = []
            if host is not None:
                tokens, scored = self._picks(plain, host)
        except Exception:
            for a in rows:
                self._fail(a, "decode")
            return
        before = c.generated
        self._decoded(rows, plain, tokens, scored)
        row_logits = [row for span in spans for row in span]  # (k + 1, V) each
        for (a, draft), logits in zip(drafted, row_logits, strict=True):
            self._verify(a, draft, logits)
        if self._p.speculative != "none":  # what a step gives a row: for how long requests take
            c.row_tokens = _ema(c.row_tokens, (c.generated - before) / len(rows))

    @staticmethod
    def _picks(rows: list[Row], host: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each plain decode row's token, sampled from its logits (host's first rows), and
        its logprob where asked."""
        tokens = sample_rows(host[: len(rows)], [a.sampler for a in rows])
        scored = [a.logprob(host[i], t) for i, (a, t) in enumerate(zip(rows, tokens, strict=True))]
        return tokens, scored

    def _decoded(
        self,
        rows: list[Row],
        plain: list[Row],
        tokens: list[int],
        scored: list[TokenLogprob | None],
    ) -> None:
        """A decode step over `rows` is done: the pace, and the plain rows' tokens."""
        c = self._counters
        c.decode_steps += 1
        c.decode_rows += len(rows)
        now = time.perf_counter()
        if self._last_decode_end is not None:
            with self._stats_lock:
                c.pace.add(now - self._last_decode_end)
        self._last_decode_end = now
        for a, token, lp in zip(plain, tokens, scored, strict=True):
            a.position += 1
            if a.spec is not None:
                a.spec.fallback_steps += 1
            self._accept(a, token, lp)

    def _mixed_step(self, rows: list[Row], group: list[Row], sizes: list[int]) -> None:
        """The decode step of `rows` (no drafts) and the prompt chunks of `group` as one
        pass (`_mixes`): the layers' matrices run once over the decode rows and the
        prompts' positions, attention a group each, so each row is what its own pass
        computes (the matrices compute a row the same in any number of rows up to
        `together_rows`: measured), and the head runs for the decode rows as a step's
        does, then for the prompts' last positions as their own pass's does."""
        model = self._transformer
        S, dev = self.config.page_size, self.config.device
        self._since_score += 1
        chunks = self._chunks(group, sizes)
        tokens: list[int] = []
        scored: list[TokenLogprob | None] = []
        try:
            padded, scratch = self._p.padded(len(rows)), self._cache.scratch_page
            began = time.perf_counter()
            xs = model.hidden_many(
                [plain_group(rows, S, dev, padded, scratch), *self._chunk_groups(group, chunks)],
                self._cache,
            )
            layers = time.perf_counter()
            host = model.logits(xs[0][:, -1]).float().cpu()  # as `forward(last_only=True)`
            heads = time.perf_counter()
            prompt_rows, scoring = self._prompt_heads(group, xs[1:])
            # The prompts' share of the pass, what their rate is learned from: the
            # layers (the decode rows are a few of its rows) and their own head.
            seconds = (layers - began) + (time.perf_counter() - heads)
            tokens, scored = self._picks(rows, host)
        except Exception:
            for a in rows:
                self._fail(a, "decode")
            for a in group:
                self._fail(a, "prefill")
            return
        self._decoded(rows, rows, tokens, scored)
        self._prefilled(group, chunks, prompt_rows, seconds, scoring, beside=True)

    def _propose(self, a: Row, planned: int) -> list[int]:
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

    def _verify(self, a: Row, draft: list[int], logits: torch.Tensor) -> None:
        """Sample `a`'s (k + 1, V) logits a position at a time, as plain steps would, and
        keep tokens up to the first that differs from the draft (or that ends the
        request). Then the keys and values rejected positions wrote are cleared and
        pages no longer needed given back: the row is where plain steps leave it."""
        assert a.spec is not None
        c = self._counters
        start = a.position
        kept = 0
        alive = True
        a.spec.begin(len(draft))
        c.spec_rounds += 1
        c.drafted += len(draft)
        for j in range(len(draft) + 1):
            try:
                token = sample_rows(logits[j : j + 1], [a.sampler])[0]
                scored = a.logprob(logits[j], token)
            except Exception:
                self._fail(a, "decode")
                alive = False
                break
            a.position = start + j + 1
            hit = j < len(draft) and token == draft[j]
            if hit:
                kept += 1
                c.accepted += 1
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
        self._cache.clear_slots([a.pages[p // S] for p in rejected], [p % S for p in rejected])
        keep = max(a.reserved_pages(S), pages_for(a.position, S))
        if len(a.pages) > keep:
            self._pages.release(a.pages[keep:])
            del a.pages[keep:]
        self._events.append((a.handle, a.step_delta()))

    # ---- a row's token and its end -----------------------------------------------------

    def _accept(
        self, a: Row, token: int, scored: TokenLogprob | None = None, *, deliver: bool = True
    ) -> bool:
        """Give `a` a sampled token; False when its stop rules ended it (finished
        here). `deliver`: send its text now (else the caller does, once the step's
        tokens of the row are all in)."""
        assert self.model is not None
        self._counters.generated += 1
        try:
            reason = a.accept(
                token, scored, eos_ids=self.model.tokenizer.eos_ids, max_context=self._p.max_context
            )
            if reason is None:
                if deliver:
                    self._events.append((a.handle, a.step_delta()))
                return True
            self._finish(a, reason)
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

    def _finish(self, a: Row, reason: FinishReason, error: str | None = None) -> None:
        if self._by_id.pop(a.handle.id, None) is None:
            return
        with self._stats_lock:
            if a in self._decoding:
                self._decoding.remove(a)
            elif a in self._waiting:
                self._waiting.remove(a)
            if a.pages:
                done = reason not in ("cancelled", "error") and a.position
                if done and self.config.prefix_cache:
                    # Its output's full pages too (a next turn of the conversation
                    # starts with them): the tokens whose keys and values were written.
                    seen, S = a.written(), self.config.page_size
                    keys = page_keys(seen, S, len(seen) // S, known=a.page_keys)
                    self._pages.index(a.pages, seen, keys)
                self._pages.release(a.pages)
                a.pages = []
        last = a.final_delta(reason)
        if last is not None:
            self._events.append((a.handle, last))
        self._events.append((a.handle, a.finish(reason, error, self._p.speculative)))

    def _fail(self, a: Row, stage: str) -> None:
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


def _ema(previous: float, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average; the first sample is taken as it is."""
    return sample if previous == 0.0 else (1 - weight) * previous + weight * sample
