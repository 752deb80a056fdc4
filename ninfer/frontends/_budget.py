"""Resolving a request against the server: sampling defaults, warnings, the token budget."""

from __future__ import annotations

from typing import Any

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import CompiledGrammar, SamplingParams, SamplingPreset, ServedModel
from protocols import ApiError

__all__ = [
    "Budget",
    "Grant",
    "SamplingRequest",
    "resolve_sampling",
    "sampling_defaults",
    "sampling_record",
]

DEFAULT_TEMPERATURE = 1.0


@attrs.frozen
class SamplingRequest:
    """The sampling fields a client sent (None: not sent)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | CompiledGrammar | None = None  # a structured output's or tools' grammar
    # llama-server's: its repetition penalty, and `samplers` (the stages to run, in order)
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    samplers: tuple[str, ...] | None = None


# Each field's value where no request, flag or model names one.
BUILT_IN: dict[str, float | int] = {
    "temperature": DEFAULT_TEMPERATURE,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def sampling_defaults(cfg: ServerConfig, preset: SamplingPreset) -> dict[str, float | int]:
    """What a request that names no sampling field gets: each field from the process
    flag, else the model's preset, else the built-in default (the seed's precedence;
    requests come on top, and --greedy last)."""
    out: dict[str, float | int] = {}
    for field, builtin in BUILT_IN.items():
        flag = getattr(cfg, field)
        model = getattr(preset, field)
        out[field] = flag if flag is not None else model if model is not None else builtin
    if cfg.greedy:
        out["temperature"] = 0.0
    return out


def sampling_record(cfg: ServerConfig, preset: SamplingPreset) -> dict[str, Any]:
    """server_start's account of the sampling defaults: the model file's preset, the
    process flags set, --greedy and --seed, and what a request naming none gets."""
    return {
        "model": {"source": preset.source, **preset.values()},
        "process": {f: v for f in BUILT_IN if (v := getattr(cfg, f)) is not None},
        "greedy": cfg.greedy,
        "seed": cfg.seed,
        "resolved": sampling_defaults(cfg, preset),
    }


def resolve_sampling(
    req: SamplingRequest, cfg: ServerConfig, preset: SamplingPreset
) -> tuple[SamplingParams, list[str]]:
    """Request fields over process flags over the model's preset over built-in defaults;
    --greedy forces argmax. Harmless ineffective fields are kept and reported as
    warnings."""
    warnings: list[str] = []
    defaults = sampling_defaults(cfg, preset)
    chosen = {f: v if (v := getattr(req, f)) is not None else defaults[f] for f in BUILT_IN}
    if cfg.greedy:
        if req.temperature not in (None, 0.0):
            warnings.append("temperature is ignored: the server forces greedy decoding")
        chosen["temperature"] = 0.0
    seed = req.seed if req.seed is not None else cfg.seed
    if chosen["temperature"] == 0.0:
        for field in ("top_p", "top_k", "min_p", "seed"):
            if getattr(req, field) is not None:
                warnings.append(f"{field} has no effect with greedy decoding (temperature 0)")
    params = SamplingParams(
        temperature=float(chosen["temperature"]),
        top_k=int(chosen["top_k"]),
        top_p=float(chosen["top_p"]),
        min_p=float(chosen["min_p"]),
        presence_penalty=float(chosen["presence_penalty"]),
        frequency_penalty=float(chosen["frequency_penalty"]),
        seed=seed,
        logit_bias=req.logit_bias,
        grammar=req.grammar,
    )
    if req.repeat_penalty is not None:
        params = attrs.evolve(params, repeat_penalty=req.repeat_penalty)
    if req.repeat_last_n is not None:
        params = attrs.evolve(params, repeat_last_n=req.repeat_last_n)
    if req.samplers is not None:
        params = follow_samplers(req.samplers, params)
    return params, warnings


# llama-server's sampler names (its `samplers`), and the stage of ninfer's each one is:
# None for those ninfer has not (they are off unless their own fields turn them on,
# which ninfer refuses), so their place in the order changes nothing.
LLAMA_SAMPLERS: dict[str, str | None] = {
    "penalties": "penalties", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "temperature": "temperature", "dry": None, "top_n_sigma": None, "typ_p": None,
    "typical_p": None, "xtc": None, "infill": None,
}  # fmt: skip
# Which stage must come before which, where both change the outcome, for ninfer's one
# pipeline (penalties, temperature, top-k, min-p, top-p: vLLM's order) to compute what
# the order asks: top-k commutes with temperature and min-p, the rest do not.
_BEFORE = (("penalties", "temperature"), ("penalties", "top_k"), ("penalties", "min_p"),
           ("penalties", "top_p"), ("temperature", "min_p"), ("temperature", "top_p"),
           ("top_k", "top_p"), ("min_p", "top_p"))  # fmt: skip


def follow_samplers(order: tuple[str, ...], params: SamplingParams) -> SamplingParams:
    """`params` as llama-server's `samplers` runs them: a stage left out of the order is
    off; the stages that change the outcome must come in an order ninfer's pipeline
    computes the same (else 400 naming `samplers`)."""
    for i, name in enumerate(order):
        if name not in LLAMA_SAMPLERS:
            raise ApiError(
                "invalid_request",
                f"samplers[{i}] is not a sampler llama.cpp's server knows",
                param=f"samplers[{i}]",
                code="invalid_value",
            )
    named = {LLAMA_SAMPLERS[n] for n in order}
    off: dict[str, Any] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    changes = {stage: value for stage, value in off.items() if stage not in named}
    if "temperature" not in named and not params.greedy:
        changes["temperature"] = 1.0
    if "penalties" not in named:
        changes.update(presence_penalty=0.0, frequency_penalty=0.0, repeat_penalty=1.0)
    params = attrs.evolve(params, **changes)
    active = {
        "penalties": params.penalized or params.repeats_penalized,
        "temperature": not params.greedy and params.temperature != 1.0,
        "top_k": params.top_k > 0,
        "min_p": params.min_p > 0.0,
        "top_p": params.top_p < 1.0,
    }
    if params.greedy:  # argmax: only the penalties change it
        active.update(top_k=False, min_p=False, top_p=False)
    place = {LLAMA_SAMPLERS[n]: i for i, n in enumerate(order) if LLAMA_SAMPLERS[n]}
    for first, then in _BEFORE:
        if active[first] and active[then] and place[first] > place[then]:
            raise ApiError(
                "invalid_request",
                f"this order runs {then} before {first}, which ninfer cannot follow with "
                f"these values: it runs penalties, temperature, top_k, min_p, top_p in that "
                f"order (top_k anywhere before top_p); reorder them, or leave {first} or "
                f"{then} at its off value",
                param="samplers",
                code="invalid_value",
            )
    return params


@attrs.frozen
class Grant:
    """A request's output budget and what of it is reserved at admission."""

    max_new_tokens: int
    reserve_tokens: int | None = None  # None: all of max_new_tokens
    clamped_from: int | None = None  # what the client asked for, when it was cut down


class Budget:
    """The one budget check: a prompt has tokens, and prompt plus output fits the
    context window and the KV pool.

    Strict (the native route): a budget that does not fit is refused, and its pages are
    reserved whole at admission. Clamping (the OpenAI and Anthropic routes, whose
    clients send large defaults): a budget past what the context and the pool leave is
    cut down to it (the answer says so), and at most `default_max_tokens` of it is
    reserved; the rest grows into free pages while there are any."""

    def __init__(self, model: ServedModel, default_max_tokens: int) -> None:
        self._model = model
        self._default = default_max_tokens

    def grant(
        self,
        prompt_tokens: int,
        requested: int | None,
        *,
        param: str,
        prompt_param: str,
        clamp: bool,
    ) -> Grant:
        """The budget of a request, or a refusal naming the parameter at fault."""
        if not clamp:
            return Grant(
                self.resolve(prompt_tokens, requested, param=param, prompt_param=prompt_param)
            )
        limit = self._room(prompt_tokens, prompt_param)
        budget = limit if requested is None else min(requested, limit)
        reserve = min(budget, self._default)  # prompt plus room fit the pool: so does this
        return Grant(
            budget,
            reserve if reserve < budget else None,
            requested if requested is not None and requested > budget else None,
        )

    def resolve(
        self, prompt_tokens: int, requested: int | None, *, param: str, prompt_param: str
    ) -> int:
        """The strict output budget, or a refusal with the numbers and the parameter at
        fault; a request that names none gets the server's default, clamped to the room
        left (a pool smaller than the default still serves requests that name none)."""
        room = self._room(prompt_tokens, prompt_param)
        if requested is None:
            return min(self._default, room)
        wrong = self._model.misfit(prompt_tokens, requested)
        if wrong is not None and wrong.limit == "context":
            ctx = self._model.max_context
            raise ApiError(
                "context_length_exceeded",
                f"the prompt has {_tokens(prompt_tokens)} and {param} asks for {requested}: "
                f"{wrong.tokens} exceeds the context window of {_tokens(ctx)}",
                param=param,
                code="context_length_exceeded",
            )
        if wrong is not None:
            raise self._too_big_for_pool(prompt_tokens, requested, param)
        return requested

    def _room(self, prompt_tokens: int, prompt_param: str) -> int:
        """The most output a prompt leaves room for in the context and the pool."""
        ctx = self._model.max_context
        if prompt_tokens == 0:
            raise ApiError("invalid_request", "the prompt produces no tokens", param=prompt_param)
        if prompt_tokens >= ctx:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt has {_tokens(prompt_tokens)}; the context window is {_tokens(ctx)} "
                "and leaves no room for output",
                param=prompt_param,
                code="context_length_exceeded",
            )
        pool = self._model.kv_pages * self._model.page_size
        room = min(ctx, pool) - prompt_tokens
        if room < 1:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt has {_tokens(prompt_tokens)}; the server's KV pool holds "
                f"{_tokens(pool)} and leaves no room for output",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return room

    def _too_big_for_pool(self, prompt_tokens: int, output: int, param: str) -> ApiError:
        pages = self._model.pages_needed(prompt_tokens, output)
        return ApiError(
            "context_length_exceeded",
            f"the prompt ({_tokens(prompt_tokens)}) plus {_tokens(output, 'output token')} needs "
            f"{pages} KV pages; the server's KV pool holds {self._model.kv_pages}",
            param=param,
            code="context_length_exceeded",
        )


def _tokens(n: int, noun: str = "token") -> str:
    """'1 token', '2 tokens'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
