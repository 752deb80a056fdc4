"""Resolving a request against the server: sampling defaults, warnings, the token budget."""

from __future__ import annotations

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import CompiledGrammar, SamplingParams, ServedModel
from protocols import ApiError

__all__ = ["Budget", "Grant", "SamplingRequest", "resolve_sampling"]

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
        logit_bias=req.logit_bias,
        grammar=req.grammar,
    )
    return params, warnings


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
        ctx = self._model.max_context
        if prompt_tokens + requested > ctx:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt has {_tokens(prompt_tokens)} and {param} asks for {requested}: "
                f"{prompt_tokens + requested} exceeds the context window of {_tokens(ctx)}",
                param=param,
                code="context_length_exceeded",
            )
        if self._model.pages_needed(prompt_tokens, requested) > self._model.kv_pages:
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
