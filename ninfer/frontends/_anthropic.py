"""The Anthropic-compatible routes as a frontend: /v1/messages, and the token count of
/v1/messages/count_tokens with the same template."""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import orjson

from ninfer.engine import TokenDelta
from ninfer.frontends._base import (
    Count,
    Frontend,
    FrontendContext,
    FrontendRoute,
    Outcome,
    Prepared,
)
from ninfer.frontends._chat import ChatCall, chat_prompt, prepare_chat
from ninfer.frontends._finish import anthropic_stop
from ninfer.frontends._output import OutputReader, PieceWriter, Reading
from ninfer.frontends._reasoning import ThinkingAsk
from ninfer.frontends._sampling import SamplingRequest
from ninfer.frontends._tools import (
    CallArgs,
    CallEnd,
    CallStart,
    Tool,
    ToolCallTurn,
    ToolPlan,
    call_id,
)
from protocols import (
    AnthropicCodec,
    AnthropicDialect,
    AnthropicMessage,
    AnthropicThinking,
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicUsage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    CountTokensResponse,
    Encoder,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDelta,
    StopDelta,
    StreamMessage,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)

__all__ = ["MessagesFrontend"]


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> AnthropicUsage:
    return AnthropicUsage(
        input_tokens=prompt_tokens - cached,
        output_tokens=output_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached,
    )


def _signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (see ThinkingBlock)."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


@attrs.define(kw_only=True)
class MessageAnswer(PieceWriter):
    """A stream's `message_start` waits for the engine's first delta, which says how much
    of the prompt the prefix cache served (its usage reports it); the frames before it
    are the HTTP headers only.

    Plain, one text block from the start. Thinking or with tools, blocks open as the
    output shows what they are: a thinking block for the reasoning (its signature sent
    before it stops), a text block for text, a tool_use block (its input streamed as
    `input_json_delta`) for each call."""

    encoder: Encoder
    id: str
    label: str  # the served name the request gave as `model`
    input_tokens: int
    reading: Reading = attrs.field(factory=Reading)
    started: bool = False
    reader: OutputReader | None = None
    blocks: int = 0  # blocks opened
    open_kind: str | None = None  # the kind of the block open now
    thought: list[str] = attrs.field(factory=list)  # the open thinking block's text
    texted: bool = False  # a text block was opened

    def head(self) -> list[bytes]:
        return []

    def _start(self, cached: int) -> list[bytes]:
        self.started = True
        message = StreamMessage(
            id=self.id,
            content=[],
            model=self.label,
            stop_reason=None,
            stop_sequence=None,
            usage=_usage(self.input_tokens, 0, cached),
        )
        sse = self.encoder.sse
        frames = [sse(MessageStart(message=message), "message_start")]
        if self.reading.plain:
            frames += self._open(TextBlock(text=""))
        else:
            self.reader = self.reading.reader()
        return [*frames, sse(Ping(), "ping")]

    def _open(self, block: ThinkingBlock | TextBlock | ToolUseBlock) -> list[bytes]:
        frames = self._close()
        self.open_kind = block.type
        self.texted = self.texted or block.type == "text"
        self.blocks += 1
        start = ContentBlockStart(index=self.blocks - 1, content_block=block)
        return [*frames, self.encoder.sse(start, "content_block_start")]

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        frames = []
        if self.open_kind == "thinking":
            signed = SignatureDelta(signature=_signature("".join(self.thought)))
            frames.append(self._piece(signed))
            self.thought = []
        self.open_kind = None
        stop = ContentBlockStop(index=self.blocks - 1)
        return [*frames, self.encoder.sse(stop, "content_block_stop")]

    def _piece(self, delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta) -> bytes:
        block = ContentBlockDelta(index=self.blocks - 1, delta=delta)
        return self.encoder.sse(block, "content_block_delta")

    def on_reasoning(self, choice: int, text: str) -> list[bytes]:
        frames = []
        if self.open_kind != "thinking":
            frames = self._open(ThinkingBlock(thinking="", signature=""))
        self.thought.append(text)
        return [*frames, self._piece(ThinkingDelta(thinking=text))]

    def on_text(self, choice: int, text: str) -> list[bytes]:
        frames = [] if self.open_kind == "text" else self._open(TextBlock(text=""))
        return [*frames, self._piece(TextDelta(text=text))]

    def on_call_start(self, choice: int, call: CallStart) -> list[bytes]:
        return self._open(ToolUseBlock(id=call_id("toolu"), name=call.name, input={}))

    def on_call_args(self, choice: int, args: CallArgs) -> list[bytes]:
        return [self._piece(InputJsonDelta(partial_json=args.text))]

    def on_call_end(self, choice: int, end: CallEnd) -> list[bytes]:
        return self._close()

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        frames = [] if self.started else self._start(delta.cached_tokens or 0)
        if self.reader is not None:
            return frames + self.write(0, self.reader.feed(delta.text, len(delta.token_ids)))
        if delta.text:
            frames.append(self._piece(TextDelta(text=delta.text)))
        return frames

    def tail(self, outcome: Outcome) -> list[bytes]:
        f = outcome.finish
        u = f.usage
        frames = [] if self.started else self._start(u.cached_tokens)
        reason = anthropic_stop(f.reason)
        if self.reader is not None:
            frames += self.write(0, self.reader.finish())
            if not self.texted and not self.reader.calls:  # an empty answer: its text block
                frames += self._open(TextBlock(text=""))
            if self.reading.tools:
                reason = anthropic_stop(f.reason, self.reader.calls, self.reader.open_call)
        frames += self._close()
        sse = self.encoder.sse
        stop = StopDelta(stop_reason=reason, stop_sequence=f.stop_string)
        usage = _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        return [
            *frames,
            sse(MessageDelta(delta=stop, usage=usage), "message_delta"),
            sse(MessageStop(), "message_stop"),
        ]

    def body(self, outcome: Outcome) -> bytes:
        f = outcome.finish
        u = f.usage
        content: list[ThinkingBlock | TextBlock | ToolUseBlock] = [TextBlock(text=outcome.text)]
        reason = anthropic_stop(f.reason)
        if not self.reading.plain:
            choice = outcome.choices[0]
            out = self.reading.read(choice.text, choice.token_ids)
            content = []
            if out.reasoning:  # as the stream: a thinking block where there is reasoning
                content.append(
                    ThinkingBlock(thinking=out.reasoning, signature=_signature(out.reasoning))
                )
            if out.has_text:
                content.append(TextBlock(text=out.text))
            content += [
                ToolUseBlock(id=call_id("toolu"), name=c.name, input=orjson.loads(c.arguments))
                for c in out.calls
            ]
            if self.reading.tools:
                reason = anthropic_stop(f.reason, len(out.calls), out.truncated)
        return self.encoder.json(
            MessageResponse(
                id=self.id,
                content=content,
                model=self.label,
                stop_reason=reason,
                stop_sequence=f.stop_string,
                usage=_usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            )
        )


class MessagesFrontend(Frontend):
    endpoint = "/v1/messages"
    protocol = "anthropic"
    dialect = AnthropicDialect()
    unversioned = True

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = AnthropicCodec()

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        count = FrontendRoute("/v1/messages/count_tokens", {"POST": Count(cls.count_tokens)})
        return (*super().routes(), count)

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_messages)
        chat = await prepare_chat(self, _chat_call(req, req.max_tokens))
        gen, _warnings = self.generation(
            request_id,
            chat.ids,
            chat.grant,
            sampling=SamplingRequest(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, grammar=chat.grammar
            ),
            stop=tuple(req.stop_sequences or ()),
        )
        answer = MessageAnswer(
            encoder=self.dialect.encoder,
            id="msg_" + request_id,
            label=chat.model,
            input_tokens=len(chat.ids),
            reading=chat.reading,
        )
        return self.prepared(
            gen, chat.grant, stream=bool(req.stream), answer=answer, log_fields=chat.log_fields
        )

    async def count_tokens(self, body: bytes) -> bytes:
        """POST /v1/messages/count_tokens: the prompt /v1/messages would build, counted."""
        req = await self.decode(body, self._codec.parse_count)
        first = await chat_prompt(self, _chat_call(req, None))
        return self.dialect.encoder.json(CountTokensResponse(input_tokens=len(first.ids)))


def _chat_call(req: MessagesRequest | CountTokensRequest, requested: int | None) -> ChatCall:
    """A Messages request (or a count of one) in the chat pipeline's words."""
    conversation: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        conversation.append({"role": "system", "content": system})
    for m in req.messages:
        conversation.extend(_turns(m))
    return ChatCall(
        model=req.model,
        conversation=conversation,
        plan=lambda: _plan(_tools(req.tools), req.tool_choice),
        thinking=_thinking_ask(req.thinking),
        requested=requested,
        budget_param="max_tokens",
    )


def _thinking_ask(thinking: AnthropicThinking | None) -> ThinkingAsk:
    """Anthropic's `thinking`: enabled or adaptive turn it on, disabled off."""
    return ThinkingAsk(None if thinking is None else thinking.enabled, None, "thinking")


def _tools(tools: list[AnthropicTool] | None) -> tuple[Tool, ...]:
    return tuple(
        Tool.checked(t.name, t.description, t.input_schema, f"tools[{i}].input_schema")
        for i, t in enumerate(tools or ())
    )


def _plan(tools: tuple[Tool, ...], choice: AnthropicToolChoice | None) -> ToolPlan | None:
    """Anthropic's choice as a plan: auto (the default), any (= required), a named tool,
    none; `disable_parallel_tool_use` makes it one call."""
    if not tools:
        return None
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    kind = "auto" if choice is None else choice.type
    named: str | dict[str, Any] = {"name": choice.name} if choice and choice.name else "auto"
    openai_choice = {"any": "required", "tool": named}.get(kind, kind)
    return ToolPlan.of(tools, openai_choice, parallel)


def _turns(m: AnthropicMessage) -> list[dict[str, Any]]:
    """A message as turns: an assistant's text and tool_use blocks are one turn with
    calls; a user's tool_result blocks are tool turns (an error result says so), then
    its text."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        calls = [ToolCallTurn(b.id or "", b.name or "", b.input or {})
                 for b in m.content if b.type == "tool_use"]  # fmt: skip
        turn: dict[str, Any] = {"role": "assistant", "content": m.text()}
        if calls:
            turn["tool_calls"] = calls
        reasoning = m.reasoning()
        if reasoning is not None:
            turn["reasoning_content"] = reasoning
        return [turn]
    turns: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id,
         "content": ("Error: " if b.is_error else "") + b.result_text()}
        for b in m.content if b.type == "tool_result"
    ]  # fmt: skip
    text = m.text()
    if text or not turns:
        turns.append({"role": "user", "content": text})
    return turns
