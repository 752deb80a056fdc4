"""The token budget: a request's prompt and output against the context window and the
KV pool, checked once (`Budget`), and what of it is reserved at admission (`Grant`)."""

from __future__ import annotations

import attrs

from ninfer.engine import ServedModel
from protocols import ApiError

__all__ = ["Budget", "Grant"]


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
