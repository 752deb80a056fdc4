"""The OpenAI-compatible routes wired to the generation flow: chat and text completions."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ninfer._budget import Limits, SamplingRequest, resolve_budget, resolve_sampling
from ninfer._config import ServerConfig
from ninfer._generation import Outcome, Prepared
from ninfer._messages import GenerationRequest, TokenDelta
from ninfer._tokenizer import ChatTemplate
from protocols import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    OpenAICodec,
    dumps,
    loads,
    openai_error_body,
    openai_status,
)

__all__ = ["OpenAIResponder", "chat_preparer", "completion_preparer", "model_card"]

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
_ROLE_FOR_TEMPLATE = {"developer": "system"}  # ChatML templates know system, not developer


def model_card(public_id: str, created: int) -> dict[str, Any]:
    return {"id": public_id, "object": "model", "created": created, "owned_by": "ninfer"}


class OpenAIResponder:
    """Chat (`chat.completion[.chunk]`) or text (`text_completion`) answers."""

    content_type_stream = b"text/event-stream"

    def __init__(self, public_id: str, *, chat: bool) -> None:
        self._model = public_id
        self._chat = chat
        self._created = int(time.time())

    def error_status(self, err: ApiError) -> int:
        return openai_status(err)

    def error(self, err: ApiError, request_id: str) -> bytes:
        return openai_error_body(err)

    def _id(self, request_id: str) -> str:
        return ("chatcmpl-" if self._chat else "cmpl-") + request_id

    def _chunk(self, request_id: str, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        obj: dict[str, Any] = {
            "id": self._id(request_id),
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice] if choice is not None else [],
            **extra,
        }
        return b"data: " + dumps(obj) + b"\n\n"

    def stream_head(self, prepared: Prepared, request_id: str) -> list[bytes]:
        if not self._chat:
            return []
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._chunk(request_id, choice)]

    def stream_delta(self, delta: TokenDelta, request_id: str) -> list[bytes]:
        if not delta.text:
            return []
        if self._chat:
            choice = {
                "index": 0,
                "delta": {"content": delta.text},
                "logprobs": None,
                "finish_reason": None,
            }
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": None}
        return [self._chunk(request_id, choice)]

    def stream_tail(self, outcome: Outcome, prepared: Prepared) -> list[bytes]:
        f = outcome.finish
        rid = outcome.request_id
        if self._chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": FINISH[f.reason]}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": FINISH[f.reason]}
        frames = [self._chunk(rid, choice)]
        if prepared.log_fields.get("include_usage"):
            frames.append(self._chunk(rid, None, usage=_usage(outcome)))
        frames.append(b"data: [DONE]\n\n")
        return frames

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]:
        return [b"data: " + openai_error_body(err) + b"\n\n", b"data: [DONE]\n\n"]

    def body(self, outcome: Outcome, prepared: Prepared) -> bytes:
        f = outcome.finish
        if self._chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": outcome.text, "refusal": None},
                "logprobs": None,
                "finish_reason": FINISH[f.reason],
            }
        else:
            choice = {
                "index": 0,
                "text": outcome.text,
                "logprobs": None,
                "finish_reason": FINISH[f.reason],
            }
        return dumps(
            {
                "id": self._id(outcome.request_id),
                "object": "chat.completion" if self._chat else "text_completion",
                "created": self._created,
                "model": self._model,
                "choices": [choice],
                "usage": _usage(outcome),
                "system_fingerprint": None,
            }
        )


def _usage(outcome: Outcome) -> dict[str, Any]:
    u = outcome.finish.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _check_model(name: str, public_ids: Mapping[str, bool]) -> None:
    if name not in public_ids:
        raise ApiError(
            "model_not_found",
            "the model named in the request is not served here; see GET /v1/models",
            param="model",
            code="model_not_found",
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


def _prepared(
    req: ChatRequest | CompletionRequest,
    ids: list[int],
    budget: int,
    config: ServerConfig,
    request_id: str,
    check: Callable[[GenerationRequest], None],
) -> Prepared:
    """The engine request and answer shape shared by chat and text completions."""
    sampling, warnings = resolve_sampling(_sampling(req), config)
    gen = GenerationRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        max_new_tokens=budget,
        sampling=sampling,
        stop=_stops(req.stop),
        ignore_eos=bool(req.ignore_eos),
    )
    check(gen)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Prepared(
        request=gen,
        stream=bool(req.stream),
        warnings=tuple(warnings),
        log_fields={"protocol": "openai", "include_usage": include_usage},
    )


def chat_preparer(
    *,
    codec: OpenAICodec,
    config: ServerConfig,
    limits: Limits,
    template: ChatTemplate | None,
    public_ids: Mapping[str, bool],
    tokenize: Callable[[str], Awaitable[list[int]]],
    request_id: str,
    check: Callable[[GenerationRequest], None],
) -> Callable[[bytes], Awaitable[Prepared]]:
    async def prepare(body: bytes) -> Prepared:
        if template is None:
            raise ApiError(
                "invalid_request",
                "this model has no chat template; use /v1/completions",
                param="messages",
            )
        req = codec.parse_chat(loads(body), supports_tools=template.supports_tools)
        _check_model(req.model, public_ids)
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
        ids = await tokenize(prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = (
            req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens)
        )
        if requested is not None and requested < 1:
            raise ApiError("invalid_request", f"{param} must be at least 1", param=param)
        budget = resolve_budget(len(ids), requested, limits, param=param, prompt_param="messages")
        return _prepared(req, ids, budget, config, request_id, check)

    return prepare


def completion_preparer(
    *,
    codec: OpenAICodec,
    config: ServerConfig,
    limits: Limits,
    public_ids: Mapping[str, bool],
    tokenize: Callable[[str], Awaitable[list[int]]],
    request_id: str,
    check: Callable[[GenerationRequest], None],
) -> Callable[[bytes], Awaitable[Prepared]]:
    async def prepare(body: bytes) -> Prepared:
        req = codec.parse_completion(loads(body))
        _check_model(req.model, public_ids)
        ids = await tokenize(req.prompt)
        if not ids:
            raise ApiError("invalid_request", "prompt produces no tokens", param="prompt")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise ApiError("invalid_request", "max_tokens must be at least 1", param="max_tokens")
        # OpenAI's legacy default for text completions is 16 tokens.
        requested = req.max_tokens if req.max_tokens is not None else 16
        budget = resolve_budget(
            len(ids), requested, limits, param="max_tokens", prompt_param="prompt"
        )
        return _prepared(req, ids, budget, config, request_id, check)

    return prepare
