"""The Anthropic-compatible routes as a frontend: /v1/messages, and the token count of
/v1/messages/count_tokens with the same template."""

from __future__ import annotations

from typing import Literal

import attrs

from ninfer.engine import TokenDelta
from ninfer.frontends._base import (
    Frontend,
    FrontendContext,
    Outcome,
    Prepared,
    clamp_headers,
)
from ninfer.frontends._budget import SamplingRequest
from protocols import (
    AnthropicCodec,
    AnthropicDialect,
    AnthropicMessage,
    AnthropicUsage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensResponse,
    Encoder,
    MessageDelta,
    MessageResponse,
    MessageStart,
    MessageStop,
    Ping,
    StopDelta,
    StreamMessage,
    TextBlock,
    TextDelta,
    loads,
)

__all__ = ["MessagesFrontend"]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]
STOP_REASON: dict[str, StopReason] = {
    "eos": "end_turn",
    "stop": "stop_sequence",
    "length": "max_tokens",
    "context": "max_tokens",
    "capacity": "max_tokens",
}


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> AnthropicUsage:
    return AnthropicUsage(prompt_tokens - cached, output_tokens, 0, cached)


@attrs.define
class MessageAnswer:
    """A stream's `message_start` waits for the engine's first delta, which says how much
    of the prompt the prefix cache served (its usage reports it); the frames before it
    are the HTTP headers only."""

    encoder: Encoder
    id: str
    label: str  # the served name the request gave as `model`
    input_tokens: int
    started: bool = False

    def head(self) -> list[bytes]:
        return []

    def _start(self, cached: int) -> list[bytes]:
        self.started = True
        message = StreamMessage(
            self.id,
            "message",
            "assistant",
            [],
            self.label,
            None,
            None,
            _usage(self.input_tokens, 0, cached),
        )
        sse = self.encoder.sse
        return [
            sse(MessageStart("message_start", message), "message_start"),
            sse(
                ContentBlockStart("content_block_start", 0, TextBlock("text", "")),
                "content_block_start",
            ),
            sse(Ping("ping"), "ping"),
        ]

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        frames = [] if self.started else self._start(delta.cached_tokens or 0)
        if delta.text:
            block = ContentBlockDelta("content_block_delta", 0, TextDelta("text_delta", delta.text))
            frames.append(self.encoder.sse(block, "content_block_delta"))
        return frames

    def tail(self, outcome: Outcome) -> list[bytes]:
        u = outcome.finish.usage
        frames = [] if self.started else self._start(u.cached_tokens)
        sse = self.encoder.sse
        stop = StopDelta(STOP_REASON[outcome.finish.reason], outcome.finish.stop_string)
        usage = _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        return [
            *frames,
            sse(ContentBlockStop("content_block_stop", 0), "content_block_stop"),
            sse(MessageDelta("message_delta", stop, usage), "message_delta"),
            sse(MessageStop("message_stop"), "message_stop"),
        ]

    def body(self, outcome: Outcome) -> bytes:
        f = outcome.finish
        u = f.usage
        return self.encoder.json(
            MessageResponse(
                self.id,
                "message",
                "assistant",
                [TextBlock("text", outcome.text)],
                self.label,
                STOP_REASON[f.reason],
                f.stop_string,
                _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            )
        )


class MessagesFrontend(Frontend):
    endpoint = "/v1/messages"
    protocol = "anthropic"

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx, AnthropicDialect())
        self._codec = AnthropicCodec()

    def _render(self, system: str | None, messages: list[AnthropicMessage]) -> str:
        conv: list[dict[str, object]] = []
        if system is not None:
            conv.append({"role": "system", "content": system})
        conv.extend({"role": m.role, "content": m.text()} for m in messages)
        return self.render_chat(conv, param="messages")

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = self._codec.parse_messages(loads(body))
        self.ctx.check_model(req.model)
        ids = await self.tokens(
            self._render(req.system_text(), req.messages), prompt_param="messages"
        )
        gen, grant, _warnings = self.request(
            request_id,
            ids,
            requested=req.max_tokens,
            param="max_tokens",
            prompt_param="messages",
            sampling=SamplingRequest(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            stop=tuple(req.stop_sequences or ()),
            clamp=True,
        )
        answer = MessageAnswer(self.dialect.encoder, "msg_" + request_id, req.model, len(ids))
        return Prepared(
            (gen,),
            bool(req.stream),
            answer,
            {"protocol": self.protocol},
            headers=clamp_headers(grant),
        )

    async def count_tokens(self, body: bytes) -> bytes:
        """POST /v1/messages/count_tokens: the prompt /v1/messages would build, counted."""
        req = self._codec.parse_count(loads(body))
        self.ctx.check_model(req.model)
        ids = await self.tokens(
            self._render(req.system_text(), req.messages), prompt_param="messages"
        )
        return self.dialect.encoder.json(CountTokensResponse(len(ids)))
