"""The OpenAI-compatible routes as frontends: chat and text completions, and the
model cards of /v1/models."""

from __future__ import annotations

import time
from typing import Literal

import attrs

from ninfer.engine import TokenDelta
from ninfer.frontends._base import Frontend, FrontendContext, Outcome, Prepared
from ninfer.frontends._budget import SamplingRequest
from protocols import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    Encoder,
    ModelCard,
    ModelList,
    OpenAICodec,
    OpenAIDialect,
    OpenAIUsage,
    PromptTokensDetails,
    loads,
)

__all__ = ["ChatFrontend", "CompletionsFrontend", "model_card", "model_list"]

FinishReason = Literal["stop", "length"]
FINISH: dict[str, FinishReason] = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context": "length",
}
_ROLE_FOR_TEMPLATE = {"developer": "system"}  # ChatML templates know system, not developer
_DONE = b"data: [DONE]\n\n"


def model_card(ctx: FrontendContext) -> ModelCard:
    return ModelCard(ctx.public_id, "model", ctx.created, "ninfer")


def model_list(ctx: FrontendContext) -> ModelList:
    return ModelList("list", [model_card(ctx)])


def _usage(outcome: Outcome) -> OpenAIUsage:
    u = outcome.finish.usage
    return OpenAIUsage(
        u.prompt_tokens, u.completion_tokens, u.total_tokens, PromptTokensDetails(u.cached_tokens)
    )


@attrs.frozen
class ChatAnswer:
    encoder: Encoder
    id: str
    model: str
    created: int
    include_usage: bool

    def _chunk(self, choice: ChatChunkChoice | None, usage: OpenAIUsage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            self.id,
            "chat.completion.chunk",
            self.created,
            self.model,
            [choice] if choice is not None else [],
            usage,
        )
        return self.encoder.sse(chunk)

    def head(self) -> list[bytes]:
        return [self._chunk(ChatChunkChoice(0, ChatDelta("assistant", ""), None, None))]

    def delta(self, delta: TokenDelta) -> list[bytes]:
        if not delta.text:
            return []
        return [self._chunk(ChatChunkChoice(0, ChatDelta(content=delta.text), None, None))]

    def tail(self, outcome: Outcome) -> list[bytes]:
        reason = FINISH[outcome.finish.reason]
        frames = [self._chunk(ChatChunkChoice(0, ChatDelta(), None, reason))]
        if self.include_usage:
            frames.append(self._chunk(None, _usage(outcome)))
        return [*frames, _DONE]

    def body(self, outcome: Outcome) -> bytes:
        message = AssistantMessage("assistant", outcome.text, None)
        choice = ChatChoice(0, message, None, FINISH[outcome.finish.reason])
        return self.encoder.json(
            ChatCompletion(
                self.id,
                "chat.completion",
                self.created,
                self.model,
                [choice],
                _usage(outcome),
                None,
            )
        )


@attrs.frozen
class CompletionAnswer:
    encoder: Encoder
    id: str
    model: str
    created: int
    include_usage: bool

    def _chunk(
        self, choice: CompletionChunkChoice | None, usage: OpenAIUsage | None = None
    ) -> bytes:
        choices = [choice] if choice is not None else []
        chunk = CompletionChunk(
            self.id, "text_completion", self.created, self.model, choices, usage
        )
        return self.encoder.sse(chunk)

    def head(self) -> list[bytes]:
        return []

    def delta(self, delta: TokenDelta) -> list[bytes]:
        if not delta.text:
            return []
        return [self._chunk(CompletionChunkChoice(0, delta.text, None, None))]

    def tail(self, outcome: Outcome) -> list[bytes]:
        frames = [self._chunk(CompletionChunkChoice(0, "", None, FINISH[outcome.finish.reason]))]
        if self.include_usage:
            frames.append(self._chunk(None, _usage(outcome)))
        return [*frames, _DONE]

    def body(self, outcome: Outcome) -> bytes:
        choice = CompletionChoice(0, outcome.text, None, FINISH[outcome.finish.reason])
        return self.encoder.json(
            Completion(
                self.id,
                "text_completion",
                self.created,
                self.model,
                [choice],
                _usage(outcome),
                None,
            )
        )


def _sampling(req: ChatRequest | CompletionRequest) -> SamplingRequest:
    return SamplingRequest(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
    )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class _OpenAIFrontend(Frontend):
    protocol = "openai"

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx, OpenAIDialect())
        self._codec = OpenAICodec()

    def _check_model(self, name: str) -> None:
        if name not in self.ctx.public_ids:
            raise ApiError(
                "model_not_found",
                "the model named in the request is not served here; see GET /v1/models",
                param="model",
                code="model_not_found",
            )

    def _prepared(
        self,
        req: ChatRequest | CompletionRequest,
        request_id: str,
        ids: list[int],
        *,
        requested: int | None,
        param: str,
        prompt_param: str,
        answer: type[ChatAnswer | CompletionAnswer],
        id_prefix: str,
    ) -> Prepared:
        gen, _warnings = self.request(
            request_id,
            ids,
            requested=requested,
            param=param,
            prompt_param=prompt_param,
            sampling=_sampling(req),
            stop=_stops(req.stop),
            ignore_eos=bool(req.ignore_eos),
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        built = answer(
            self.dialect.encoder,
            id_prefix + request_id,
            self.ctx.public_id,
            int(time.time()),  # OpenAI's `created`: when this completion was made
            include_usage,
        )
        return Prepared(gen, bool(req.stream), built, {"protocol": self.protocol})


class ChatFrontend(_OpenAIFrontend):
    endpoint = "/v1/chat/completions"

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        template = self.ctx.model.tokenizer.chat_template
        if template is None:
            raise ApiError(
                "invalid_request",
                "this model has no chat template; use /v1/completions",
                param="messages",
            )
        req = self._codec.parse_chat(loads(body), supports_tools=template.supports_tools)
        self._check_model(req.model)
        messages = [
            {"role": _ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()}
            for m in req.messages
        ]
        try:
            prompt = template.render(messages, add_generation_prompt=True)
        except ValueError:
            raise ApiError(
                "invalid_request",
                "the chat template refused this conversation (check the order of roles)",
                param="messages",
            ) from None
        ids = await self.tokens(prompt, prompt_param="messages")
        requested: int | None = req.max_tokens
        param = "max_tokens"
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        return self._prepared(
            req,
            request_id,
            ids,
            requested=requested,
            param=param,
            prompt_param="messages",
            answer=ChatAnswer,
            id_prefix="chatcmpl-",
        )


class CompletionsFrontend(_OpenAIFrontend):
    endpoint = "/v1/completions"

    # OpenAI's legacy default for text completions is 16 tokens.
    DEFAULT_MAX_TOKENS = 16

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = self._codec.parse_completion(loads(body))
        self._check_model(req.model)
        ids = await self.tokens(req.prompt, prompt_param="prompt")
        requested = req.max_tokens if req.max_tokens is not None else self.DEFAULT_MAX_TOKENS
        return self._prepared(
            req,
            request_id,
            ids,
            requested=requested,
            param="max_tokens",
            prompt_param="prompt",
            answer=CompletionAnswer,
            id_prefix="cmpl-",
        )
