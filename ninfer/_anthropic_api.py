"""The Anthropic-compatible routes wired to the generation flow: /v1/messages."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ninfer._budget import Limits, SamplingRequest, resolve_budget, resolve_sampling
from ninfer._config import ServerConfig
from ninfer._generation import Outcome, Prepared
from ninfer._messages import GenerationRequest, TokenDelta
from ninfer._tokenizer import ChatTemplate
from protocols import (
    AnthropicCodec,
    ApiError,
    anthropic_error_body,
    anthropic_status,
    dumps,
    loads,
    sse_event,
)
from protocols._anthropic import Message

__all__ = ["AnthropicResponder", "messages_preparer", "render_conversation"]

STOP_REASON = {
    "eos": "end_turn",
    "stop": "stop_sequence",
    "length": "max_tokens",
    "context": "max_tokens",
}


def render_conversation(
    template: ChatTemplate | None, system: str | None, messages: list[Message]
) -> str:
    if template is None:
        raise ApiError("invalid_request", "this model has no chat template", param="messages")
    conv: list[dict[str, Any]] = []
    if system is not None:
        conv.append({"role": "system", "content": system})
    conv.extend({"role": m.role, "content": m.text()} for m in messages)
    try:
        return template.render(conv, add_generation_prompt=True)
    except ValueError:
        raise ApiError(
            "invalid_request", "the chat template refused this conversation", param="messages"
        ) from None


class AnthropicResponder:
    content_type_stream = b"text/event-stream"

    def __init__(self, label: str) -> None:
        self.label = label  # the request's `model` field, echoed back once parsed

    def error_status(self, err: ApiError) -> int:
        return anthropic_status(err)

    def error(self, err: ApiError, request_id: str) -> bytes:
        return anthropic_error_body(err, request_id)

    def stream_head(self, prepared: Prepared, request_id: str) -> list[bytes]:
        message: dict[str, Any] = {
            "id": "msg_" + request_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.label,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prepared.request.prompt_ids), "output_tokens": 0},
        }
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            sse_event("ping", {"type": "ping"}),
        ]

    def stream_delta(self, delta: TokenDelta, request_id: str) -> list[bytes]:
        if not delta.text:
            return []
        return [
            sse_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": delta.text},
                },
            )
        ]

    def stream_tail(self, outcome: Outcome, prepared: Prepared) -> list[bytes]:
        f = outcome.finish
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASON[f.reason], "stop_sequence": f.stop_string},
                    "usage": {"output_tokens": f.usage.completion_tokens},
                },
            ),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]:
        return [b"event: error\ndata: " + anthropic_error_body(err, request_id) + b"\n\n"]

    def body(self, outcome: Outcome, prepared: Prepared) -> bytes:
        f = outcome.finish
        return dumps(
            {
                "id": "msg_" + outcome.request_id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": outcome.text}],
                "model": self.label,
                "stop_reason": STOP_REASON[f.reason],
                "stop_sequence": f.stop_string,
                "usage": {
                    "input_tokens": f.usage.prompt_tokens,
                    "output_tokens": f.usage.completion_tokens,
                },
            }
        )


def messages_preparer(
    *,
    codec: AnthropicCodec,
    config: ServerConfig,
    limits: Limits,
    template: ChatTemplate | None,
    tokenize: Callable[[str], Awaitable[list[int]]],
    request_id: str,
    check: Callable[[GenerationRequest], None],
    on_label: Callable[[str], None],
) -> Callable[[bytes], Awaitable[Prepared]]:
    async def prepare(body: bytes) -> Prepared:
        req = codec.parse_messages(loads(body))
        on_label(req.model)
        prompt = render_conversation(template, req.system_text(), req.messages)
        ids = await tokenize(prompt)
        budget = resolve_budget(
            len(ids), req.max_tokens, limits, param="max_tokens", prompt_param="messages"
        )
        sampling, warnings = resolve_sampling(
            SamplingRequest(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            config,
        )
        gen = GenerationRequest(
            request_id=request_id,
            prompt_ids=tuple(ids),
            max_new_tokens=budget,
            sampling=sampling,
            stop=tuple(req.stop_sequences or ()),
        )
        check(gen)
        return Prepared(
            request=gen,
            stream=bool(req.stream),
            warnings=tuple(warnings),
            log_fields={"protocol": "anthropic"},
        )

    return prepare
