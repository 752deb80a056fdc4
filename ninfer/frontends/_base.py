"""What every frontend is and shares.

A frontend is one protocol's generation route, built once when the model is ready.
It owns its codec, its chat template and limits, and the shape of its answers:
`prepare(body, request_id)` parses and checks the body, renders and tokenizes the
prompt, resolves the budget and sampling, and returns a `Prepared` whose `answer`
writes this request's body or stream frames. Its `dialect` writes its refusals.
The request flow (`ninfer._flow`) drives any frontend the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import Finish, GenerationRequest, ServedModel, TokenDelta
from ninfer.frontends._budget import Budget, SamplingRequest, resolve_sampling
from protocols import ApiError, Dialect

__all__ = ["Answer", "Frontend", "FrontendContext", "Outcome", "Prepared"]

Tokenize = Callable[[str], Awaitable[list[int]]]


@attrs.frozen
class Outcome:
    """A finished generation, for building its answer."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish
    timing: Mapping[str, float]


class Answer(Protocol):
    """One request's answer in its protocol: the whole body, or the stream's frames."""

    def head(self) -> list[bytes]:
        """Frames right after the stream's headers."""
        ...

    def delta(self, delta: TokenDelta) -> list[bytes]: ...

    def tail(self, outcome: Outcome) -> list[bytes]: ...

    def body(self, outcome: Outcome) -> bytes: ...


@attrs.frozen
class Prepared:
    """What a frontend's preparation produces: the engine request and its answer."""

    request: GenerationRequest
    stream: bool
    answer: Answer
    log_fields: Mapping[str, Any]  # request_start fields beyond the engine request's


@attrs.frozen
class FrontendContext:
    """What frontends share, fixed once the model is loaded."""

    model: ServedModel
    config: ServerConfig
    public_id: str  # the name the server answers to (--model-id, or the model's own)
    tokenize: Tokenize  # off the event loop for long texts
    created: int  # unix seconds, for OpenAI's `created`

    @property
    def public_ids(self) -> frozenset[str]:
        return frozenset({self.public_id, self.model.identity.model_id})


class Frontend(abc.ABC):
    """One protocol's generation route."""

    endpoint: str  # the route, as the request log and metrics name it
    protocol: str  # request_start's `protocol`

    def __init__(self, ctx: FrontendContext, dialect: Dialect) -> None:
        self.ctx = ctx
        self.dialect = dialect
        self.budget = Budget(ctx.model, ctx.config.default_max_tokens)

    async def tokens(self, text: str, *, prompt_param: str) -> list[int]:
        """The prompt's tokens, or a refusal without tokenizing a text that cannot fit
        the context: more bytes than the context's tokens could cover, at the most bytes
        one token covers, is more tokens than the context (never a text that fits)."""
        model = self.ctx.model
        limit = model.max_context * model.tokenizer.max_token_bytes
        # A character is at most 4 UTF-8 bytes: only a text near the bound is measured.
        if len(text) * 4 > limit and (
            len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit
        ):
            raise ApiError(
                "context_length_exceeded",
                f"the prompt is longer than a context of {model.max_context} tokens can "
                "hold (counted before tokenizing)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return await self.ctx.tokenize(text)

    @abc.abstractmethod
    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        """Parse, check and tokenize `body`; raise ApiError naming what is at fault."""

    def request(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        requested: int | None,
        param: str,
        prompt_param: str,
        sampling: SamplingRequest,
        stop: tuple[str, ...],
        ignore_eos: bool = False,
    ) -> tuple[GenerationRequest, tuple[str, ...]]:
        """The engine request every frontend ends with (after the one budget check),
        and the warnings about fields that had no effect."""
        budget = self.budget.resolve(
            len(prompt_ids), requested, param=param, prompt_param=prompt_param
        )
        params, warnings = resolve_sampling(sampling, self.ctx.config)
        gen = GenerationRequest(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=budget,
            sampling=params,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        return gen, tuple(warnings)
