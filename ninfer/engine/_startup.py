"""The engine's start-up decisions, made once on the engine thread before it is ready,
into one frozen `StartupPlan` that the loop reads and `Engine.served` reports.

In order (`start_up`): the KV pool's size against the memory left after the weights;
the self-check of the kernels (a wrong native kernel falls back, `_selfcheck`); the
batch sizes whose rows are computed as alone (`_invariance`; narrowed bfloat16
matrices where that gives more of them and the self-check agrees); whether prompts are
prefilled together; whether decode batches are invariant (else every step padded to
the largest); the speculative backend (only where a verifying pass changes no bit); the
report of all of it (all of which a later start of the same everything adopts instead,
`_checkcache`); the KV tensors (the native layers keep their keys transposed); a
warm-up pass; the cost of a pass per row (what drafting is worth).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import attrs
import torch
from structlog.typing import FilteringBoundLogger

from ninfer.engine._checkcache import (
    Verdict,
    key_material,
    now_utc,
    read_verdict,
    verdict_key,
    write_verdict,
)
from ninfer.engine._contract import (
    KV_HEADROOM_BYTES,
    KV_MEMORY_FLOOR_BYTES,
    CompiledGrammar,
    EngineConfig,
    KVSizing,
    PathCheck,
    ServedModel,
    kv_dtype_conflict,
)
from ninfer.engine._errors import ConfigError
from ninfer.engine._gguf import ModelArgs
from ninfer.engine._invariance import invariant_batch_sizes, rows_independent_of_count
from ninfer.engine._kernels import loaded_library
from ninfer.engine._kvpool import KVPages, PagePool, pages_for
from ninfer.engine._loader import LoadedModel, trim_heap
from ninfer.engine._memory import available_memory
from ninfer.engine._native import Packed
from ninfer.engine._selfcheck import SelfCheck, SelfCheckFailed, probe_tokens
from ninfer.engine._speculative import step_logits

__all__ = ["Started", "StartupPlan", "keys_per_token", "served_model", "start_up"]

# The least seconds between two readings of the memory left for never-used KV pages on
# the CPU (a reading takes ~0.3 ms; the pool reads only when it takes such pages).
MEMORY_READ_EVERY_S = 0.1
# Panels (16 outputs each) of every native matrix kind on which batching is measured
# (`_measured`): several, so that the product is split among the threads.
MEASURED_PANELS = 8
_Map = TypeVar("_Map")


def _measured(m: _Map) -> _Map:
    """What a batching property of `m` is measured on: a native matrix's first
    MEASURED_PANELS panels (how the kernels block a product's rows does not depend on its
    outputs, each output's sum being its own: `Packed.panels`), another map whole.
    Products over whole matrices took 4 s of a 1.7B model's start-up (prefilling
    together, up to 1,024 rows) and 1-2 s of a 1B's (batch sizes, its 128,256-row head
    at each size up to --max-batch) and measure nothing more."""
    return cast(_Map, m.panels(MEASURED_PANELS)) if isinstance(m, Packed) else m


# Rows of the pass whose cost is measured against one row's (measure_row_cost).
ROW_COST_ROWS = 17
# What a pass costs per row against its fixed cost, where it was not measured.
DEFAULT_ROW_COST = 9.0
# Attention's arithmetic per key is this many times less efficient than the matrices'
# (measured on SmolLM2 on the 2-core machine with the blocked attention kernel: a
# prompt token costs ~1.45 ms in the matrices and ~0.62 us per key it attends to (from
# the prompt rates at ~530 and ~7,850 tokens), where their arithmetic says 3,070 keys a
# token's matrices: a ratio of 1.3; it was 3 with the kernel before).
ATTENTION_INEFFICIENCY = 1.3


def keys_per_token(args: ModelArgs) -> float:
    """How many keys a prompt token attends to for its attention to cost what its
    weight matrices do (from the model's shape, with ATTENTION_INEFFICIENCY)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    matrices = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.ffn_dim
    per_key = 2 * args.n_heads * args.head_dim  # scores and values, per layer
    return max(1.0, matrices / per_key / ATTENTION_INEFFICIENCY)


@attrs.frozen
class StartupPlan:
    """What start-up decided; fixed for the engine's life."""

    max_context: int  # tokens a request may span
    sizing: KVSizing  # how the pool was sized
    # Batch sizes whose rows are computed as in any other (a step is padded up to one).
    batch_sizes: tuple[int, ...]
    batch_invariant: bool  # a row's numbers never depend on its batch (promised)
    # Rows a pass may have when prompts are prefilled together: 0 when they cannot be
    # (the layers' matmuls compute a row differently in another number of rows).
    together_rows: int
    keys_per_token: float  # keys_per_token(the model's shape): how chunks shrink
    self_check: tuple[PathCheck, ...]  # each fast path's check, in the order checked
    speculative: str  # "none", or the backend verified to change no token
    # The sampler's top-p on the native kernels (they serve, and the self-check found it
    # keeps what the full sort keeps); else the full sort.
    native_top_p: bool = False
    # top-k's tokens on the native kernels likewise (the self-check found them torch's)
    native_top_k: bool = False
    # A step's top-k rows sampled in one native call (the self-check found its picks
    # those of its float64 definition); else each row alone with torch calls
    native_sample: bool = False
    # What a pass costs per row against its fixed cost, c1 / c0 inverted (measured
    # once the engine is warm, when it speculates; else the default).
    row_cost: float = DEFAULT_ROW_COST
    # The sliding window and the share of the layers that attend within it (Gemma 3: 5 of
    # 6); 0: every layer sees the whole row (`attended`).
    window: int = 0
    local_share: float = 0.0

    def attended(self, depth: int) -> float:
        """The keys a prompt token `depth` tokens in attends to, a layer on average: the
        whole row in a global layer, at most the window in a local one (what its cost
        grows with, against keys_per_token). Counting the whole row in every layer of
        Gemma 3 270M put its passes deep in a prompt at ~4x their cost, and a prompt's
        first passes beside a stream, sized by the rate learned there, took 150-240 ms
        of a 0.1 s budget."""
        if self.window <= 0 or self.local_share <= 0.0:
            return float(depth)
        return (1.0 - self.local_share) * depth + self.local_share * min(depth, self.window)

    def prefill_units(self, tokens: int, depth: int) -> float:
        """What `tokens` prompt tokens `depth` in cost, in tokens at depth 0: each 1 for
        its matrices and attended(depth) / keys_per_token for its attention (what a
        pass's time budget is spent in, `Engine._prefill`)."""
        return tokens * (1 + self.attended(depth) / self.keys_per_token)

    def padded(self, rows: int) -> int:
        """The batch size `rows` rows are padded to: the next one whose rows are
        computed as in any other (see _invariance)."""
        return _padded(self.batch_sizes, rows)


@attrs.frozen
class Started:
    """A started engine's parts: the model as it runs (its kernels after the self-check),
    the plan, the page accounting and the KV tensors."""

    model: LoadedModel
    plan: StartupPlan
    pool: PagePool
    kv: KVPages


def served_model(
    model: LoadedModel,
    plan: StartupPlan,
    config: EngineConfig,
    load_seconds: float,
    compile_grammar: Callable[[str], CompiledGrammar],
) -> ServedModel:
    """What the server sees of a started engine: the model, the plan, the limits."""
    return ServedModel(
        identity=model.identity,
        tokenizer=model.tokenizer,
        load_seconds=load_seconds,
        max_context=plan.max_context,
        page_size=config.page_size,
        kv_pages=plan.sizing.tokens // config.page_size,
        dtype=config.dtype,
        device=config.device,
        batch_invariant=plan.batch_invariant,
        batch_sizes=plan.batch_sizes,
        prefill_together_rows=plan.together_rows,
        self_check=plan.self_check,
        kernels=model.kernels,
        speculative=plan.speculative,
        compile_grammar=compile_grammar,
        sampling_preset=model.sampling_preset,
        kv_sizing=plan.sizing,
        embedding_length=model.transformer.args.dim,
    )


def kv_store(config: EngineConfig) -> str:
    """What the KV pool stores (--kv-dtype resolved): auto is float16 beside float32
    activations (the self-check may still refuse it: then float32) and the activations'
    own dtype beside bfloat16; float16 and float32 pools hold float32 activations' keys.
    Raises ConfigError for a float pool beside bfloat16 activations."""
    if config.kv_dtype == "auto":
        return "float16" if config.dtype == "float32" else "auto"
    conflict = kv_dtype_conflict(config.kv_dtype, config.dtype)
    if conflict is not None:
        raise ConfigError(conflict)
    return config.kv_dtype


def start_up(loaded: LoadedModel, config: EngineConfig, log: FilteringBoundLogger) -> Started:
    """Every start-up decision for `loaded` under `config`, then a warm-up pass. Raises
    ConfigError (a pool that cannot fit) or the self-check's SelfCheckFailed."""
    return _Startup(loaded, config, log).run()


def _less_mapped(reading: tuple[int, str], mapped: int) -> tuple[int, str]:
    """An `available_memory` reading less `mapped` bytes of matrices mapped from a pack
    file, where the reading is the kernel's MemAvailable: that counts the page cache as
    memory to be had, and those pages are the model's (a cgroup's usage already counts
    them)."""
    available, source = reading
    if source == "MemAvailable" and mapped:
        return available - mapped, f"MemAvailable less {mapped >> 20} MiB of mapped matrices"
    return available, source


class _Startup:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, log: FilteringBoundLogger):
        self.loaded = loaded
        self.config = config
        self.log = log
        ctx = loaded.identity.context_length
        self.max_context = min(config.max_context or ctx, ctx)
        self.batch_sizes: list[int] = [1]
        self.together_rows = 0
        self.batch_invariant = False
        self.speculative = "none"
        self.native_top_p = False
        self.native_top_k = False
        self.native_sample = False
        self.self_check: tuple[PathCheck, ...] = ()
        self.kv_dtype = kv_store(config)
        self.narrowed = False
        # What the checks compute from and its key, when verdicts are kept (`_checkcache`)
        self.material: dict[str, Any] | None = None
        self.key = ""

    def padded(self, rows: int) -> int:
        """As StartupPlan.padded, over the batch sizes decided so far (the self-check
        measures padded batches before the plan exists)."""
        return _padded(self.batch_sizes, rows)

    def run(self) -> Started:
        cfg = self.config
        sizing, pool = self.page_pool()
        model = self.loaded.transformer
        kept = self.kept_verdict()
        if kept is not None:  # checked by an earlier start of the same everything
            self.adopt(kept)
        else:
            sizing, pool = self.checked(sizing, pool)
        if self.loaded.source is not None:
            self.loaded = attrs.evolve(self.loaded, source=None)  # the file's map goes
            trim_heap()
        # After the kernel check: the native layers keep their keys transposed, torch's not.
        kv = KVPages.allocate(
            model.args, n_pages=pool.n_pages, page_size=cfg.page_size, dtype=model.dtype,
            device=cfg.device, kv_dtype=self.kv_dtype, keys_transposed=model.native is not None,
        )  # fmt: skip
        if model.native is not None:
            # The native kernels have their own threads; torch's ops between their calls
            # (sampling, a step's bookkeeping) are small, and on torch's threads they left
            # OpenMP workers spinning on the cores the kernels' threads need (a decode
            # step took 11 ms instead of 5.6 beside a sampled row's softmax).
            torch.set_num_threads(1)
        _warm_up(self.loaded, pool, kv, cfg.device)
        plan = StartupPlan(
            max_context=self.max_context,
            sizing=sizing,
            batch_sizes=tuple(self.batch_sizes),
            batch_invariant=self.batch_invariant,
            together_rows=self.together_rows,
            keys_per_token=keys_per_token(model.args),
            window=model.args.sliding_window,
            local_share=sum(map(model.args.is_local, range(model.args.n_layers)))
            / max(1, model.args.n_layers),
            self_check=self.self_check,
            speculative=self.speculative,
            native_top_p=self.native_top_p,
            native_top_k=self.native_top_k,
            native_sample=self.native_sample,
        )
        if self.speculative != "none":
            plan = attrs.evolve(plan, row_cost=self.measure_row_cost(pool, kv))
        return Started(model=self.loaded, plan=plan, pool=pool, kv=kv)

    def checked(self, sizing: KVSizing, pool: PagePool) -> tuple[KVSizing, PagePool]:
        """Every start-up check, in order: a model loaded from its file has its kernels
        checked (falling back where one is wrong, raising where none is right) and the
        float16 pool (auto falls to a float32 one, sized again: the sizing and pool
        returned); then top-p and top-k, the batches and speculation; the self-check
        reported, and its verdict kept where it is clean."""
        cfg, model = self.config, self.loaded.transformer
        check = None
        if self.loaded.source is not None:
            tokens = probe_tokens(self.loaded.tokenizer, self.loaded.identity.vocab_size)
            check = SelfCheck(model, self.loaded.source, tokens, weights=cfg.weights,
                              kv_dtype=self.kv_dtype)  # fmt: skip
            check.kernels()  # falls back where a kernel is wrong; raises where none is right
            if model.native is None and self.loaded.kernels.startswith("native"):
                refused = "torch (the self-check refused the native kernels)"
                self.loaded = attrs.evolve(self.loaded, kernels=refused)
            if self.kv_dtype == "float16" and not check.kv_float16():
                if cfg.kv_dtype == "float16":
                    raise SelfCheckFailed("the float16 KV pool computes wrong")
                self.kv_dtype = "float32"  # auto: the float32 pool, sized again
                check.kv_dtype = self.kv_dtype  # and the whole passes checked on one
                sizing, pool = self.page_pool()
        # The native kernels' top-p where they serve: checked against the full sort when
        # the model came from its file (else taken as their tests found it).
        self.native_top_p = model.native is not None and (check is None or check.top_p())
        self.native_top_k = model.native is not None and (check is None or check.top_k())
        # the batched sampler runs top-k and top-p's stages itself: checked where both passed
        self.native_sample = (
            self.native_top_k and self.native_top_p and (check is None or check.sample())
        )
        self.batches(check)
        if cfg.spec != "none":
            self.speculation(check)
        if check is not None:
            self.report(check)
            self.keep_verdict(check)
        return sizing, pool

    def kept_verdict(self) -> Verdict | None:
        """The verdict an earlier start kept for exactly this model, code, CPU and
        configuration (`_checkcache`), when verdicts are kept and the model came from its
        file on the CPU; else None (and the key, for keeping this start's)."""
        cfg, loaded = self.config, self.loaded
        if cfg.check_cache is None or loaded.source is None or cfg.device != "cpu":
            return None
        self.material = key_material(cfg, loaded.identity.sha256, loaded.kernels, loaded_library())
        self.key = verdict_key(self.material)
        return read_verdict(cfg.check_cache, self.key)

    def adopt(self, kept: Verdict) -> None:
        """Take a kept verdict's decisions, and say so in place of the check's report."""
        self.self_check = kept.self_check
        self.kv_dtype = kept.kv_dtype  # the kept one is the kind asked for: sizing stands
        self.batch_sizes = list(kept.batch_sizes)
        self.together_rows = kept.together_rows
        self.batch_invariant = True  # only invariant verdicts are kept
        self.speculative = kept.speculative
        self.native_top_p = kept.native_top_p
        self.native_top_k = kept.native_top_k
        self.native_sample = kept.native_sample
        self.log.info(
            "self_check",
            kernels=self.loaded.kernels,
            seconds=0.0,
            passed=[r.path for r in kept.self_check],
            refused=[],
            kept_from=kept.checked_at,
            key=self.key,
        )

    def keep_verdict(self, check: SelfCheck) -> None:
        """Keep this start's verdict for the next (`_checkcache`) when it can be adopted
        without changing a thing: every path passed, nothing narrowed, batches invariant,
        speculation as asked."""
        cfg = self.config
        if self.material is None or cfg.check_cache is None:
            return
        clean = (
            all(r.ok for r in check.results)
            and not self.narrowed
            and self.batch_invariant
            and self.speculative == cfg.spec
        )
        if not clean:
            return
        verdict = Verdict(
            self_check=tuple(check.results),
            kv_dtype=self.kv_dtype,
            batch_sizes=tuple(self.batch_sizes),
            together_rows=self.together_rows,
            speculative=self.speculative,
            native_top_p=self.native_top_p,
            native_top_k=self.native_top_k,
            native_sample=self.native_sample,
            seconds=round(check.seconds, 3),
            checked_at=now_utc(),
        )
        why = write_verdict(cfg.check_cache, self.key, self.material, verdict)
        if why:
            self.log.warning("self_check_not_kept", directory=cfg.check_cache, error=why)

    def page_pool(self) -> tuple[KVSizing, PagePool]:
        """The pool's sizing (`size_pool`, for the KV dtype decided so far) and its pages'
        accounting."""
        sizing = self.size_pool()
        pool = PagePool(
            n_pages=sizing.tokens // self.config.page_size,
            page_size=self.config.page_size,
            room=self.memory_room(sizing),
            room_every_s=MEMORY_READ_EVERY_S,
        )
        return sizing, pool

    def size_pool(self) -> KVSizing:
        """The pool's size in tokens, against the memory left after the weights: as many
        whole pages as fit with KV_HEADROOM_BYTES to spare (--kv-capacity auto; fewer
        than one sequence is refused), or the capacity asked for, never reduced (refused
        where it cannot fit at all)."""
        cfg = self.config
        args, dtype = self.loaded.transformer.args, self.loaded.transformer.dtype
        kv_dtype = self.kv_dtype
        per_token = KVPages.bytes_per_token(args, dtype, kv_dtype)
        page_bytes = per_token * cfg.page_size
        available, source = _less_mapped(available_memory(cfg.device), self.loaded.mapped_bytes)
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
            kv_dtype=kv_dtype if kv_dtype != "auto" else str(dtype).removeprefix("torch."),
            tokens=pages * cfg.page_size,
            bytes_per_token=per_token,
            pool_bytes=pool_bytes,
            available_bytes=available,
            memory_source=source,
            headroom_bytes=headroom,
        )

    def memory_room(self, sizing: KVSizing) -> Callable[[], int] | None:
        """On the CPU, how many more pages the machine has memory for now, with
        KV_MEMORY_FLOOR_BYTES left (the pool's memory is committed page by page as
        pages are first written, and others may take memory meanwhile); None on CUDA,
        where the whole pool is committed when it is made."""
        device = self.config.device
        if device.startswith("cuda"):
            return None
        per_page = self.config.page_size * sizing.bytes_per_token
        mapped = self.loaded.mapped_bytes  # (the closure holds no more than this number)
        return lambda: (
            (_less_mapped(available_memory(device), mapped)[0] - KV_MEMORY_FLOOR_BYTES) // per_page
        )

    def batches(self, check: SelfCheck | None) -> None:
        """The batch sizes, prefilling together, and whether batches are invariant."""
        cfg = self.config
        model = self.loaded.transformer
        sizes = invariant_batch_sizes(
            [_measured(m) for m in model.row_maps()], max_rows=cfg.max_batch, device=cfg.device
        )
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
                self.narrowed = True
                self.log.info("dense_weights_narrowed", dtype="bfloat16", batch_sizes=narrow)
                sizes = narrow
        self.batch_sizes = sizes or list(range(1, cfg.max_batch + 1))
        # Prompts are prefilled in one pass only if that changes none of their numbers:
        # measured on each kind of matrix of the layers (up to 1,024 rows a pass), then
        # on the model whole with real prompts.
        together = min(cfg.prefill_chunk, 1024)
        independent = sizes is not None and rows_independent_of_count(
            [_measured(m) for m in model.layer_maps()], max_rows=together, device=cfg.device
        )
        if independent and (check is None or check.together(cfg.page_size, self.padded)):
            self.together_rows = together
        # bfloat16 is never promised: batched rows were seen to drift from the same rows
        # alone on this CPU even with every linear shape measured invariant.
        self.batch_invariant = sizes is not None and cfg.dtype == "float32"
        invariant = self.batch_invariant
        if check is not None and invariant and not check.decode_batch(cfg.page_size, self.padded):
            self.batch_sizes = [cfg.max_batch]  # every row computed as in the largest
            self.batch_invariant = check.decode_batch(
                cfg.page_size, self.padded, "decode_batch_padded"
            )
        if not self.batch_invariant:
            self.log.warning("batching_not_invariant", dtype=cfg.dtype)

    def speculation(self, check: SelfCheck | None) -> None:
        """Speculate (--spec) only where verifying a draft computes each position as a
        plain step would: every matrix, the head too, computes a row the same in any
        number of rows up to the most a pass can have (measured), and a verifying pass
        gives the real model's plain-step logits bit for bit (the self-check). Else the
        engine decodes without, and says why."""
        cfg = self.config
        model = self.loaded.transformer
        most = self.padded(cfg.max_batch) + cfg.max_batch * (cfg.draft_tokens + 1)
        # The layers' matrices, unless measured up to as many rows for prefilling
        # prompts together; and the head.
        measured = self.together_rows >= most
        maps = [*([] if measured else model.layer_maps()), model.lm_head]
        if not self.batch_invariant or not rows_independent_of_count(
            [_measured(m) for m in maps], max_rows=most, device=cfg.device
        ):
            self.log.warning(
                "fast_path_refused",
                path="speculative",
                error="a row's numbers depend on how many rows a pass has",
                instead="no speculation",
            )
            return
        if check is not None and not check.speculative(cfg.page_size, self.padded):
            return  # reported with the rest of the self-check
        self.speculative = cfg.spec

    def report(self, check: SelfCheck) -> None:
        """The self-check on the console and in the log: a warning for each path
        refused (and what runs instead), one line for the whole."""
        self.self_check = tuple(check.results)
        for r in check.results:
            if not r.ok:
                self.log.warning(
                    "fast_path_refused",
                    path=r.path,
                    error=r.error,
                    tolerance=r.tolerance,
                    instead=r.instead or None,
                )
        self.log.info(
            "self_check",
            kernels=self.loaded.kernels,
            seconds=round(check.seconds, 3),
            passed=[r.path for r in check.results if r.ok],
            refused=[r.path for r in check.results if not r.ok],
        )

    def measure_row_cost(self, pool: PagePool, kv: KVPages) -> float:
        """c0 / c1 of a pass costing about c0 + c1 x rows (`plan_drafts`): a pass of
        one row and one of ROW_COST_ROWS (a prompt's positions, as a verifying row
        has), each the median of five after a first. Decides how much drafting is
        worth; never what is computed."""
        cfg = self.config
        rows = min(ROW_COST_ROWS, cfg.max_batch * (cfg.draft_tokens + 1))
        pages = pool.allocate(pages_for(rows, cfg.page_size))
        if pages is None:  # a pool too small to measure in: the default ratio stays
            return DEFAULT_ROW_COST
        kv.zero_pages(pages)
        dev = cfg.device
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
                step_logits(self.loaded.transformer, kv, None, [group])
                times.append(time.perf_counter() - began)
            return sorted(times[1:])[2]

        one, many = median_pass(1), median_pass(rows)
        pool.release(pages)
        per_row = max((many - one) / (rows - 1), one * 1e-4)
        self.log.info(
            "speculative_decoding",
            backend=self.speculative,
            draft_tokens=cfg.draft_tokens,
            pass_seconds=round(one, 4),
            row_seconds=round(per_row, 5),
        )
        return max(1.0, (one - per_row) / per_row)


def _warm_up(loaded: LoadedModel, pool: PagePool, kv: KVPages, device: str) -> None:
    """One tiny prefill and decode so the first request does not pay for kernel setup."""
    pages = pool.allocate(1)
    assert pages is not None
    kv.zero_pages(pages)
    model = loaded.transformer
    table = torch.tensor([pages], device=device)
    tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
    model.forward(tokens, torch.arange(2).view(1, 2), table, kv, last_only=True)
    model.forward(tokens[:, :1], torch.tensor([[2]]), table, kv, last_only=True)
    pool.release(pages)


def _padded(batch_sizes: Sequence[int], rows: int) -> int:
    """The first of `batch_sizes` (ascending) that holds `rows` rows; `rows` past them."""
    return next((n for n in batch_sizes if n >= rows), rows)


def _gib(n: int) -> str:
    """A size for people: GiB to two places, or MiB under one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
