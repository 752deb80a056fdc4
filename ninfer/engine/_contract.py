"""The engine's face to the server, free of torch and trio.

What goes in (a `GenerationRequest` with its `SamplingParams`), what comes out
(`TokenDelta` events and exactly one `Finish`), what the server may know of a
loaded model (`ServedModel`: identity, tokenizer, chat template, limits), how the
engine is configured (`EngineConfig`, `DTYPE_NAMES`, `WEIGHT_MODES`) and how it
reports (`EngineStatistics`). The server imports this module and nothing else of
`ninfer.engine`; only the bridge (`ninfer._bridge`) starts the torch side.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs

__all__ = [
    "DTYPE_NAMES",
    "KERNEL_MODES",
    "KV_DTYPES",
    "LLAMA_ORDER",
    "POOLINGS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "WEIGHT_MODES",
    "ChatTemplate",
    "ChatText",
    "CompiledGrammar",
    "EmbedSpec",
    "Embedding",
    "EngineConfig",
    "EngineStatistics",
    "EngineTimings",
    "Event",
    "EventSink",
    "Finish",
    "FinishReason",
    "GenerationRequest",
    "KVSizing",
    "Misfit",
    "ModelIdentity",
    "PathCheck",
    "Pooling",
    "RequestHandle",
    "SamplingParams",
    "SamplingPreset",
    "ServedModel",
    "ThinkingSupport",
    "TokenDelta",
    "TokenLogprob",
    "Tokenizer",
    "Usage",
    "kv_dtype_conflict",
    "misfit",
    "opens_thinking",
    "pages_for",
    "reserved_pages",
]

# Activation dtypes and weight layouts by name; the engine maps them to torch types.
DTYPE_NAMES = ("float32", "bfloat16")
# The KV cache's storage (--kv-dtype): auto (float16 beside float32 activations where the
# self-check passes it, else float32; the activations' dtype beside bfloat16), float16,
# float32, or int8 with scales.
KV_DTYPES = ("auto", "float16", "float32", "int8")
WEIGHT_MODES = ("int4", "dense")
# Which kernels run the model (--kernels): ninfer's own native CPU kernels, torch's, or
# the native ones where they are built and pass the start-up self-check, else torch's.
KERNEL_MODES = ("auto", "native", "torch")
# Speculative decoding backends (--spec): none, or drafts from the row's own n-grams
# (and, for a constrained row, the tokens its grammar forces).
SPEC_BACKENDS = ("none", "ngram")

# eos: an end-of-sequence token; stop: a stop string; length: the output budget;
# context: the end of the context window; capacity: past its reserved output, no free
# KV page was left to grow into; cancelled: the caller cancelled;
# error: serving this request failed (the message says why, the log has detail);
# embedded: an embedding request's prompt was computed (its Finish carries the vector).
FinishReason = Literal[
    "eos", "stop", "length", "context", "capacity", "cancelled", "error", "embedded"
]

# How an embedding request's token states become its vector (llama.cpp's --pooling):
# their mean, the last token's, the first token's (cls), or none (one vector a token).
Pooling = Literal["mean", "last", "cls", "none"]
POOLINGS: tuple[Pooling, ...] = ("mean", "last", "cls", "none")


@attrs.frozen
class EmbedSpec:
    """An embedding request: its prompt is computed (no output is sampled), and its
    final-norm hidden states, pooled and normalized, come back in its Finish."""

    pooling: Pooling = "mean"
    # llama.cpp's embd_normalize: -1 none, 0 max absolute scaled to int16's range,
    # 1 taxicab, 2 euclidean, p > 2 the p-norm. Pooling `none` is never normalized.
    normalize: int = 2


@attrs.frozen
class Embedding:
    """An embedding request's vectors: `rows` float32 vectors of `dim` values, little-
    endian, row after row (one row when pooled, one a prompt token with pooling none)."""

    data: bytes = attrs.field(repr=False)
    rows: int
    dim: int

    def row(self, i: int) -> bytes:
        """Vector i's bytes (OpenAI's base64 encoding of it)."""
        n = 4 * self.dim
        return self.data[i * n : (i + 1) * n]

    def vectors(self) -> list[list[float]]:
        """The vectors as floats (each float32 value exactly, as a Python float)."""
        values = array.array("f")
        values.frombytes(self.data)
        if sys.byteorder != "little":
            values.byteswap()
        flat = values.tolist()
        return [flat[i * self.dim : (i + 1) * self.dim] for i in range(self.rows)]


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A grammar with the engine's matcher for it, built on the caller's thread
    (`ServedModel.compile_grammar`): the engine gives each row a copy (microseconds)
    instead of compiling on its own thread, where a large schema's compile (hundreds of
    milliseconds) would stall every row of the batch."""

    text: str  # the llguidance grammar
    matcher: object = attrs.field(repr=False)  # the engine's, in its initial state
    param: str = ""  # where the request gave it (a refusal names it)


# A Finish's `error` when the grammar engine gave up on a row mid-output: a limit of
# its own (llguidance: at most 2,000 items in a row, such as an anyOf of 3,000 objects
# or an object of 500 optional properties), reached only when decoding gets there.
# The request is answered 400 naming the grammar's parameter, not 500.
GRAMMAR_LIMIT = (
    "the output's schema needs more than the grammar engine can follow while decoding "
    "(at most 2,000 alternatives or about 500 optional properties at one point)"
)


# A sampling stage after the penalties, and ninfer's order of them.
Stage = Literal["temperature", "top_k", "min_p", "top_p"]
DEFAULT_ORDER: tuple[Stage, ...] = ("temperature", "top_k", "min_p", "top_p")
# llama-server's order of them (its default `samplers`, the stages ninfer has): the
# filters on the untempered distribution, the temperature last.
LLAMA_ORDER: tuple[Stage, ...] = ("top_k", "top_p", "min_p", "temperature")


@attrs.frozen
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's repetition penalty: each token among the last `repeat_last_n` output
    # tokens (-1: all of them) has its logit divided by it where positive, multiplied
    # where negative (1.0: off).
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    # (token id, bias) pairs added to the row's logits before anything else (OpenAI's
    # logit_bias; -100 bans a token, +100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # An llguidance grammar the output must match, token by token (a structured
    # output's JSON schema or a request's tools, compiled by the frontend), as text or
    # already compiled for the engine.
    grammar: str | CompiledGrammar | None = None
    # The order of the filtering stages after the penalties: ninfer's (vLLM's) by
    # default; a request's llama-server `samplers` may name another (its own default
    # runs temperature last, on the tokens its filters kept).
    order: tuple[Stage, ...] = DEFAULT_ORDER

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def repeats_penalized(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0


# The sampling fields a preset may set, with the range a request may send for each
# (a model file's recommendation outside it is not used).
PRESET_FIELDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 2**31 - 1),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}


@attrs.frozen
class SamplingPreset:
    """A model's own sampling defaults: what a request gets for a field that neither it
    nor the process names (None: no recommendation; the built-in default applies).
    `source` says where they came from (the GGUF file's `general.sampling.*` keys)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    source: str = "none"

    def values(self) -> dict[str, float | int]:
        """The fields it sets."""
        return {f: v for f in PRESET_FIELDS if (v := getattr(self, f)) is not None}


# Memory --kv-capacity auto leaves free beside the pool (activations, the logits, the
# allocator's slack, the rest of the process and the machine).
KV_HEADROOM_BYTES = 1 << 30

# Memory the pool's pages never take on the CPU, however large the pool: a page never
# written before is taken only while at least this much would stay available after it
# (other processes may have taken memory since the pool was sized; docs/serving.md).
KV_MEMORY_FLOOR_BYTES = 256 << 20

# A Finish's `error` when a request's KV pages found no memory: every page the pool
# has touched is free and still too few, and the machine has no memory for more (the
# request is answered 503 engine_unavailable, with Retry-After).
KV_MEMORY = "the server has no memory left for this request's KV cache"


@attrs.frozen
class KVSizing:
    """How the KV pool was sized: the ledger server_start and the console show."""

    mode: Literal["auto", "explicit"]
    kv_dtype: str  # what the pool stores (KV_DTYPES; auto resolved to the dtype's name)
    tokens: int  # the pool, in tokens (whole pages)
    bytes_per_token: int  # keys and values of every layer
    pool_bytes: int  # the pool's memory, padding and scratch pages included
    available_bytes: int  # free for it when it was sized (after the weights)
    memory_source: str  # where available_bytes came from
    headroom_bytes: int  # what auto left free

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def kv_dtype_conflict(kv_dtype: str, dtype: str) -> str | None:
    """Why --kv-dtype `kv_dtype` cannot go with --dtype `dtype` (a float pool holds float32
    activations' keys), or None."""
    if kv_dtype in ("float16", "float32") and dtype != "float32":
        return f"--kv-dtype {kv_dtype} needs --dtype float32 (got {dtype}): give auto or int8"
    return None


def pages_for(tokens: int, page_size: int) -> int:
    """The KV pages `tokens` tokens take."""
    return -(-tokens // page_size)


def reserved_pages(prompt_tokens: int, reserved_tokens: int, page_size: int) -> int:
    """KV pages a request holds from the start of its prefill: its whole prompt plus the
    output reserved for it (the one count the scheduler admits by and the engine takes)."""
    return pages_for(prompt_tokens + reserved_tokens, page_size)


@attrs.frozen
class Misfit:
    """Why a prompt and its output can never run: past the context window (`context`),
    or more KV pages than the whole pool (`pool`)."""

    limit: Literal["context", "pool"]
    tokens: int  # prompt plus output
    pages: int  # the pages they need


def misfit(
    prompt_tokens: int, output_tokens: int, *, max_context: int, kv_pages: int, page_size: int
) -> Misfit | None:
    """The one rule of whether a prompt and its output fit, for the frontends' budget
    and the engine's own check alike."""
    tokens = prompt_tokens + output_tokens
    pages = pages_for(tokens, page_size)
    if tokens > max_context:
        return Misfit("context", tokens, pages)
    if pages > kv_pages:
        return Misfit("pool", tokens, pages)
    return None


@attrs.frozen
class GenerationRequest:
    """One protocol-neutral request for the engine."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Output tokens whose KV pages are reserved up front (None: all of max_new_tokens).
    # Past them the request grows into free pages, and ends (`capacity`) when none is
    # left that a waiting request needs.
    reserve_tokens: int | None = None

    @property
    def reserved_tokens(self) -> int:
        """Output tokens whose pages are held from the start of its prefill."""
        return self.max_new_tokens if self.reserve_tokens is None else self.reserve_tokens

    # Log probabilities of each output token with this many alternatives (None: none).
    logprobs: int | None = None
    # Log probabilities of the prompt's tokens (from the second on), with this many
    # alternatives (None: none). The whole prompt is then computed: no prefix cache.
    prompt_logprobs: int | None = None
    # A PromptProgress event after each prefill pass over its prompt (llama-server's
    # `return_progress`).
    progress: bool = False
    # An embedding request (max_new_tokens 0): its whole prompt is computed, never
    # served from the prefix cache, and its Finish (reason `embedded`) carries the vector.
    embed: EmbedSpec | None = None

    @property
    def events_bound(self) -> int:
        """The most events it can receive: a TokenDelta per output token, the Finish, and
        with `progress` a PromptProgress per prefill pass (each takes a token at least)
        and the one before the first pass."""
        passes = len(self.prompt_ids) + 1 if self.progress else 0
        return self.max_new_tokens + 2 + passes


@attrs.frozen
class RequestHandle:
    """What `Engine.submit` returns; events carry it and `Engine.cancel` takes it."""

    id: int
    request_id: str


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class EngineTimings:
    """Seconds spent by the engine: waiting in its queue, prefilling, decoding."""

    wait_s: float
    prefill_s: float
    decode_s: float


@attrs.frozen
class TokenLogprob:
    """A token's log probability under the model (log-softmax of its float32 logits,
    before bias, penalties and temperature), and the most likely tokens at its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@attrs.frozen
class TokenDelta:
    """New tokens of one request from one engine step, and the text they complete."""

    token_ids: tuple[int, ...]
    text: str
    # On a request's first delta only: its prompt tokens served from the prefix cache
    # (known once its prefill began), for answers that report them up front.
    cached_tokens: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked for
    # On the first delta only, when asked for: one per prompt token (None for the first).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # The engine's seconds for it so far: its prefill, and its decoding up to this
    # step (llama-server's per-token `timings`).
    prefill_s: float = 0.0
    decode_s: float = 0.0


@attrs.frozen
class PromptProgress:
    """How far a request's prompt is prefilled (llama-server's `prompt_progress`): sent
    when its prefill begins and after each pass, when the request asks for it."""

    total: int  # prompt tokens
    cached: int  # of them served from the prefix cache
    processed: int  # of them in the KV cache now (cached ones included)
    elapsed_s: float  # since its prefill began


@attrs.frozen
class SpeculativeCounts:
    """What speculative decoding did for one request (the request log's `speculative`)."""

    backend: str  # --spec
    draft_window: int  # --draft-tokens: the most tokens one round drafts
    rounds: int  # decode steps in which the request's row verified a draft
    drafted_tokens: int
    accepted_tokens: int  # drafted tokens kept (each saved a decode step)
    fallback_steps: int  # decode steps in which it had no draft (one token each)
    accepted_per_position: tuple[int, ...]  # rounds whose i-th drafted token was kept

    def __add__(self, other: SpeculativeCounts) -> SpeculativeCounts:
        """The counts of several choices of one request, together."""
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + (0,) * (width - len(self.accepted_per_position))
        b = other.accepted_per_position + (0,) * (width - len(other.accepted_per_position))
        return SpeculativeCounts(
            backend=self.backend,
            draft_window=max(self.draft_window, other.draft_window),
            rounds=self.rounds + other.rounds,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            fallback_steps=self.fallback_steps + other.fallback_steps,
            accepted_per_position=tuple(x + y for x, y in zip(a, b, strict=True)),
        )


@attrs.frozen
class Finish:
    """The last event of a request: exactly one per request."""

    reason: FinishReason
    usage: Usage
    timings: EngineTimings
    seed: int | None
    stop_string: str | None = None
    error: str | None = None
    speculative: SpeculativeCounts | None = None  # when the engine speculates (--spec)
    embedding: Embedding | None = None  # an embedding request's (reason `embedded`)


Event = TokenDelta | PromptProgress | Finish


class EventSink(Protocol):
    """Where the engine thread publishes: once per step, never once per token."""

    def deliver(self, events: list[tuple[RequestHandle, Event]]) -> None: ...


@attrs.frozen
class EngineConfig:
    max_batch: int = 8
    kv_capacity: int | Literal["auto"] = 16384  # tokens in the page pool, or as many as fit
    page_size: int = 16
    prefill_chunk: int = 256
    prefix_cache: bool = True  # reuse cached prompt prefixes (docs/engine.md)
    max_context: int | None = None  # None: the model's own context length
    dtype: str = "float32"  # one of DTYPE_NAMES
    weights: str = "int4"  # one of WEIGHT_MODES
    device: str = "cpu"
    chat_template: str | None = None  # Jinja text over the file's own (--chat-template)
    spec: str = "none"  # speculative decoding: one of SPEC_BACKENDS
    kv_dtype: str = "auto"  # one of KV_DTYPES
    draft_tokens: int = 8  # the most tokens a row drafts a step, with --spec
    kernels: str = "auto"  # one of KERNEL_MODES
    # Threads of the engine's kernels (None: the CPUs this process may use)
    threads: int | None = None
    # The cache directory: where a native kernels library may be built when the package's
    # own folder is not writable, and where files' digests are remembered (digests/);
    # None: the library only in the package, every digest computed
    cache_dir: str | None = None
    # Where the start-up checks' verdicts are kept between starts (`_checkcache`); None:
    # none kept, every start checks (--self-check always)
    check_cache: str | None = None
    # Where the native kernels' packed matrices are kept between starts and mapped by the
    # next (`_packcache`); None: every start packs them from the file (--no-packed-cache)
    packed_cache: str | None = None


@attrs.frozen
class EngineStatistics:
    state: str  # starting | loading | ready | stopped | failed
    waiting: int  # submitted, not yet prefilling
    prefilling: int
    decoding: int
    pages_total: int
    pages_used: int
    pages_free: int
    steps: int
    last_progress: float  # time.monotonic() of the last completed step or idle wait
    slowest_recent_step: float  # seconds: the longest of the last RECENT_STEPS steps
    busy: bool
    batch_invariant: bool  # whether a row's tokens are independent of its batch
    batch_sizes: tuple[int, ...]  # decode batches are padded up to one of these sizes
    decode_steps: int  # cumulative
    decode_rows: int  # cumulative rows over all decode steps (occupancy = rows / steps)
    prefill_tokens: int  # cumulative prompt tokens computed
    prefill_passes: int  # cumulative forward passes that computed them
    cached_prompt_tokens: int  # cumulative prompt tokens served from the prefix cache
    pages_cached: int  # full prompt pages indexed in the prefix cache (held or idle)
    generated_tokens: int  # cumulative tokens sampled
    # Recent pace, for estimates (0.0 until measured): seconds between consecutive decode
    # steps while decoding (prefill chunks between them included; the median of the last
    # 32), and
    # prefill seconds per prompt token (decaying sums of seconds over tokens).
    decode_step_seconds: float = 0.0
    prefill_seconds_per_token: float = 0.0
    # Tokens a decode step gives a row (a moving average): 1 without speculation.
    decode_tokens_per_row: float = 1.0
    # Speculative decoding, cumulative: rows' verifying rounds, tokens drafted, drafted
    # tokens kept.
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Native kernel calls run on the engine thread alone, cumulative: the kernels' threads
    # were waiting on each other while other processes took the cores (0 on torch's).
    kernel_solo_calls: int = 0


@attrs.frozen
class ModelIdentity:
    model_id: str
    architecture: str
    sha256: str
    context_length: int
    vocab_size: int
    path: str
    # The GGUF's `<arch>.pooling_type` (an embedding model's), when it has one
    pooling: Pooling | None = None


@attrs.frozen
class ChatText:
    """A rendered chat prompt whose client strings are escaped (`_controltext`): only
    the control tokens its template wrote are control tokens when it is encoded with
    `Tokenizer.encode_chat`. Not for display: the escapes are private-use characters."""

    text: str


# A thinking model's reasoning block, as chat templates write it and models answer it.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (the reply it asks
    for begins as reasoning)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@attrs.frozen
class ThinkingSupport:
    """What a chat template does with reasoning (a thinking model's `<think>` block),
    found by rendering it: whether `enable_thinking` switches thinking on and off,
    whether the reply it prompts for begins inside an open `<think>` with thinking on,
    and whether `preserve_thinking` keeps the reasoning of closed turns in the history."""

    switch: bool
    opens: bool
    preserve: bool


class ChatTemplate(Protocol):
    """A model's chat template, rendered in a sandbox."""

    @property
    def source(self) -> str:
        """The template's Jinja text, as the model file (or --chat-template) gave it."""
        ...

    @property
    def writes_tool_calls(self) -> bool:
        """Whether the template offers tools and writes calls in Hermes' markup itself."""
        ...

    @property
    def bos_token(self) -> str:
        """The model's BOS token's text, as the template is given it ("" for none)."""
        ...

    @property
    def eos_token(self) -> str:
        """The model's EOS token's text, as the template is given it."""
        ...

    @property
    def thinking(self) -> ThinkingSupport | None:
        """How the template handles reasoning; None: it has none (no thinking model)."""
        ...

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str: ...

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> ChatText:
        """`render` with every client string escaped: for `Tokenizer.encode_chat`
        (`variables`: more template variables, e.g. enable_thinking)."""
        ...


class Tokenizer(Protocol):
    """What the server needs of a model's tokenizer: text to ids, and its template."""

    @property
    def chat_template(self) -> ChatTemplate | None: ...

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token covers (an upper bound)."""
        ...

    def encode(self, text: str) -> list[int]:
        """A prompt's ids; control tokens written in `text` are control tokens (the
        native and completions routes, whose clients write the template themselves)."""
        ...

    def encode_chat(self, chat: ChatText) -> list[int]:
        """A rendered chat's ids: its template's control tokens as control tokens, the
        client's text as plain text, whatever it spells."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids with control tokens' texts read as plain text (llama.cpp's
        `parse_special: false`), the BOS token first when the model wants one."""
        ...

    def chat_prompt(self, chat: ChatText) -> str:
        """A rendered chat as text (the client's strings as sent): what it would be
        tokenized from, for display."""
        ...

    def exceeds(self, prompt: str | ChatText, limit: int, *, special: bool = True) -> bool:
        """Whether `prompt` (as `encode_chat`, or `encode` / `encode_plain` by `special`,
        would encode it) has more than `limit` tokens: counted in pieces, stopping as
        soon as the count passes `limit`, so that a hopeless text costs about `limit`
        tokens' worth of tokenizing, not its whole length."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (part of a UTF-8 character, for some byte-level tokens)."""
        ...


@attrs.frozen
class PathCheck:
    """One fast path's known-answer check at start-up (`_selfcheck`): its worst error
    against the float64 computation of the file's values, the tolerance it was held
    to, and what the engine uses instead when it failed (empty when it passed)."""

    path: str  # e.g. "int4_kernel", "head", "attention", "prefill_together"
    ok: bool
    error: float  # relative; 0.0 where bit-identity is the test
    tolerance: float
    instead: str = ""  # the exact path used instead, when not ok

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path, "ok": self.ok, "error": self.error, "tolerance": self.tolerance
        }  # fmt: skip
        if self.instead:
            out["instead"] = self.instead
        return out


@attrs.frozen
class ServedModel:
    """A loaded model as the server sees it: identity, text handling and the engine's
    limits, fixed once loading has finished. Holds no tensor."""

    identity: ModelIdentity
    tokenizer: Tokenizer
    load_seconds: float  # reading the file, the self-check and warming up: until ready
    max_context: int  # tokens a request may span (prompt plus output)
    page_size: int  # tokens per KV page
    kv_pages: int  # pages in the pool
    dtype: str
    device: str
    batch_invariant: bool
    batch_sizes: tuple[int, ...]
    # Rows a prefill pass may have when prompts are prefilled together (0: one prompt a
    # pass, as the layers' matmuls compute a row differently in other row counts).
    prefill_together_rows: int = 0
    # Speculative decoding as it runs: "none", or the backend (--spec) when the engine
    # verified at start-up that it changes no token (else it runs without, and says so).
    speculative: str = "none"
    # The self-check of every fast path the engine chose, in the order checked.
    self_check: tuple[PathCheck, ...] = ()
    # How the KV pool was sized (None: an engine that does not say).
    kv_sizing: KVSizing | None = None
    # Which kernels run the model: "native <isa>, <n> threads", or "torch" and why
    kernels: str = "torch"
    # The model file's recommended sampling defaults (under process flags and requests).
    sampling_preset: SamplingPreset = attrs.field(factory=SamplingPreset)
    # Compiles a grammar for this engine on the calling thread (thread-safe; ValueError
    # for a grammar it refuses); None where the engine takes grammars as text only.
    compile_grammar: Callable[[str], CompiledGrammar] | None = attrs.field(default=None, eq=False)
    # The width of its hidden states: an embedding's values (0: an engine that does not say)
    embedding_length: int = 0

    def pages_needed(self, prompt_tokens: int, reserved_tokens: int) -> int:
        """KV pages a request reserves: its whole prompt plus its reserved output."""
        return reserved_pages(prompt_tokens, reserved_tokens, self.page_size)

    def misfit(self, prompt_tokens: int, output_tokens: int) -> Misfit | None:
        """Why a prompt and that much output can never run here (None: they can)."""
        return misfit(
            prompt_tokens,
            output_tokens,
            max_context=self.max_context,
            kv_pages=self.kv_pages,
            page_size=self.page_size,
        )
