"""A request's sampling against the server's: the defaults (the model file's preset
under the process flags, under the request), the record server_start logs of them, and
llama-server's `samplers` order followed where ninfer's one pipeline computes it."""

from __future__ import annotations

from typing import Any

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import LLAMA_ORDER, CompiledGrammar, SamplingParams, SamplingPreset, Stage
from protocols import ApiError

__all__ = [
    "SamplingRequest",
    "follow_samplers",
    "resolve_sampling",
    "sampling_defaults",
    "sampling_record",
]

DEFAULT_TEMPERATURE = 0.8


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


# Each field's value where no request, flag or model names one: llama-server's default
# chain (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), not OpenAI's plain
# temperature 1. Chosen by measurement (benchmarks/defaults.py; docs/api.md, "Sampling
# defaults"): on SmolLM2, requests naming nothing got the right answer 78% of the time
# with it, 49% without it, and answers wandered off topic without it.
BUILT_IN: dict[str, float | int] = {
    "temperature": DEFAULT_TEMPERATURE,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


# The fields of the filtering chain. A request that names none of them runs the chain in
# llama-server's order (LLAMA_ORDER); one naming any of them, in ninfer's (vLLM's).
# GET /props does not show the order as llama-server's `samplers`: with it there,
# llama.cpp's web UI lost the answer it resumed after a reload (benchmarks/webui.py,
# step 6, failed in two runs of two; passed in three without it).
_FILTER_FIELDS = ("temperature", "top_k", "top_p", "min_p")


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
    elif all(getattr(req, f) is None for f in _FILTER_FIELDS):
        # A chain the request leaves whole to the defaults runs as llama-server runs it,
        # for its values are llama.cpp's (its built-in chain, a GGUF's
        # general.sampling.*, flags named as its own): the filters on the untempered
        # distribution, the temperature last (docs/api.md, "Sampling defaults", where it
        # was measured). A request naming any of them gets ninfer's (vLLM's) order.
        params = attrs.evolve(params, order=LLAMA_ORDER)
    return params, warnings


# llama-server's sampler names (its `samplers`), and the stage of ninfer's each one is:
# None for those ninfer has not (they are off unless their own fields turn them on,
# which ninfer refuses), so their place in the order changes nothing.
LLAMA_SAMPLERS: dict[str, str | None] = {
    "penalties": "penalties", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "temperature": "temperature", "dry": None, "top_n_sigma": None, "typ_p": None,
    "typical_p": None, "xtc": None, "infill": None,
}  # fmt: skip
# Pairs of stages whose order changes the outcome where both are on (top-k commutes
# with temperature and min-p): ninfer's order (penalties, temperature, top-k, min-p,
# top-p: vLLM's) runs the first of each first. An order that reverses one of these is
# followed as given (SamplingParams.order); the penalties always run first.
_BEFORE = (("temperature", "min_p"), ("temperature", "top_p"), ("top_k", "top_p"),
           ("min_p", "top_p"))  # fmt: skip
_FILTERS: tuple[Stage, ...] = ("temperature", "top_k", "min_p", "top_p")


def follow_samplers(order: tuple[str, ...], params: SamplingParams) -> SamplingParams:
    """`params` as llama-server's `samplers` runs them: a stage left out of the order is
    off, the filtering stages run in the order given (ninfer's own where that computes
    the same), the penalties first (an order that puts them after a stage that changes
    the outcome is refused, 400 naming `samplers`)."""
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
    for then in _FILTERS:
        if active["penalties"] and active[then] and place["penalties"] > place[then]:
            raise ApiError(
                "invalid_request",
                f"this order runs {then} before penalties, which ninfer cannot follow with "
                f"these values: it runs the penalties first; reorder them, or leave "
                f"{then} or the penalties at their off value",
                param="samplers",
                code="invalid_value",
            )
    if any(active[a] and active[b] and place[a] > place[b] for a, b in _BEFORE):
        ranked = sorted(_FILTERS, key=lambda stage: place.get(stage, len(order)))
        params = attrs.evolve(params, order=tuple(ranked))
    return params
