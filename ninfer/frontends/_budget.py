"""Resolving a request against the server: sampling defaults, warnings, the token budget."""

from __future__ import annotations

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import SamplingParams, ServedModel
from protocols import ApiError

__all__ = ["Budget", "SamplingRequest", "resolve_sampling"]

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


def resolve_sampling(req: SamplingRequest, cfg: ServerConfig) -> tuple[SamplingParams, list[str]]:
    """Request fields over process flags over built-in defaults; --greedy forces argmax.
    Harmless ineffective fields are kept and reported as warnings."""
    warnings: list[str] = []
    temperature = req.temperature
    if temperature is None:
        temperature = cfg.temperature if cfg.temperature is not None else DEFAULT_TEMPERATURE
    if cfg.greedy:
        if req.temperature not in (None, 0.0):
            warnings.append("temperature is ignored: the server forces greedy decoding")
        temperature = 0.0
    top_p = req.top_p if req.top_p is not None else (cfg.top_p if cfg.top_p is not None else 1.0)
    top_k = req.top_k if req.top_k is not None else (cfg.top_k if cfg.top_k is not None else 0)
    min_p = req.min_p if req.min_p is not None else 0.0
    seed = req.seed if req.seed is not None else cfg.seed
    if temperature == 0.0:
        for field in ("top_p", "top_k", "min_p", "seed"):
            if getattr(req, field) is not None:
                warnings.append(f"{field} has no effect with greedy decoding (temperature 0)")
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=seed,
    )
    return params, warnings


class Budget:
    """The one budget check: a prompt has tokens, and prompt plus output fits the
    context window and the KV pool (whose pages are reserved whole at admission)."""

    def __init__(self, model: ServedModel, default_max_tokens: int) -> None:
        self._model = model
        self._default = default_max_tokens

    def resolve(
        self, prompt_tokens: int, requested: int | None, *, param: str, prompt_param: str
    ) -> int:
        """The output budget, or a refusal with the numbers and the parameter at fault."""
        ctx = self._model.max_context
        if prompt_tokens == 0:
            raise ApiError("invalid_request", "the prompt produces no tokens", param=prompt_param)
        if prompt_tokens >= ctx:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt has {prompt_tokens} tokens; the context window is {ctx} tokens "
                "and leaves no room for output",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            # Clamped to what the context leaves and what the KV pool can hold (a pool
            # smaller than the default budget still serves requests that name none).
            pool = self._model.kv_pages * self._model.page_size
            budget = min(self._default, ctx - prompt_tokens, pool - prompt_tokens)
            if budget < 1:
                raise ApiError(
                    "context_length_exceeded",
                    f"the prompt has {prompt_tokens} tokens; the server's KV pool holds "
                    f"{pool} tokens and leaves no room for output",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
        else:
            if prompt_tokens + requested > ctx:
                raise ApiError(
                    "context_length_exceeded",
                    f"the prompt has {prompt_tokens} tokens and {param} asks for {requested}: "
                    f"{prompt_tokens + requested} exceeds the context window of {ctx} tokens",
                    param=param,
                    code="context_length_exceeded",
                )
            budget = requested
        pages = self._model.pages_needed(prompt_tokens, budget)
        if pages > self._model.kv_pages:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt ({prompt_tokens} tokens) plus {budget} output tokens needs "
                f"{pages} KV pages; the server's KV pool holds {self._model.kv_pages}",
                param=param if requested is not None else prompt_param,
                code="context_length_exceeded",
            )
        return budget
