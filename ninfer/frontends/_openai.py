"""The OpenAI-compatible routes as frontends: chat and text completions, and the
model cards of /v1/models."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import attrs

from ninfer.engine import (
    CompiledGrammar,
    GenerationRequest,
    PromptProgress,
    TokenDelta,
    Tokenizer,
    TokenLogprob,
)
from ninfer.frontends._base import (
    Choice,
    Count,
    Frontend,
    FrontendContext,
    FrontendRoute,
    Look,
    Outcome,
    PathArgs,
    Prepared,
    Routed,
    clamp_headers,
)
from ninfer.frontends._budget import Grant
from ninfer.frontends._chat import ChatCall, chat_prompt, prepare_chat
from ninfer.frontends._finish import FINISH, chat_finish
from ninfer.frontends._output import OutputReader, PieceWriter, Reading
from ninfer.frontends._reasoning import ThinkingAsk
from ninfer.frontends._sampling import SamplingRequest
from ninfer.frontends._structured import ANY_JSON_OBJECT
from ninfer.frontends._timings import Clock, final_timings, progress_body
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
    ApiError,
    AppliedTemplate,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatFinish,
    ChatLogprobs,
    ChatMessage,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    Encoder,
    FunctionCall,
    FunctionCallDelta,
    LlamaTimings,
    ModelCard,
    ModelList,
    ModelMeta,
    OpenAICodec,
    OpenAIDialect,
    OpenAIUsage,
    PromptProgressBody,
    PromptTokensDetails,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    logit_bias_pairs,
    replayed_arguments,
)

__all__ = ["ChatFrontend", "CompletionsFrontend", "ModelsFrontend"]

_DONE = b"data: [DONE]\n\n"


class ModelsFrontend(Routed):
    """GET /v1/models: the served model's one card, its public id with the other served
    names as `aliases` and llama-server's `meta`; /v1/models/{model}: the card under
    any served name."""

    dialect = OpenAIDialect()
    unversioned = True

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        return (
            FrontendRoute("/v1/models", {"GET": Look(cls.listing)}),
            FrontendRoute("/v1/models/{model}", {"GET": Look(cls.card)}, rest=True),
        )

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        model = ctx.model
        try:  # once: the file served does not change while it is served
            size: int | None = os.stat(model.identity.path).st_size
        except OSError:
            size = None
        self._meta = ModelMeta(
            n_vocab=model.identity.vocab_size,
            n_ctx=model.max_context,
            n_ctx_train=model.identity.context_length,
            size=size,
        )

    def _card(self, name: str) -> ModelCard:
        aliases = [n for n in self.ctx.names if n != name]
        return ModelCard(
            id=name, created=self.ctx.created, owned_by="ninfer", aliases=aliases, meta=self._meta
        )

    def listing(self, call: PathArgs) -> bytes:
        cards = ModelList(data=[self._card(self.ctx.public_id)])
        return self.dialect.encoder.json(cards)

    def card(self, call: PathArgs) -> bytes:
        name = self.ctx.check_model(call.params["model"])
        return self.dialect.encoder.json(self._card(name))


def _usage(outcome: Outcome) -> OpenAIUsage:
    u = outcome.usage
    return OpenAIUsage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


def _tier(requested: str | None) -> str | None:
    """The service tier answered: the one asked for ("auto" is served as "default")."""
    return "default" if requested == "auto" else requested


@attrs.frozen
class Spelling:
    """Token ids to the strings and bytes logprobs report."""

    tokenizer: Tokenizer

    def bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", "replace")

    def chat(self, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
        def top(tid: int, lp: float) -> TopLogprob:
            return TopLogprob(token=self.text(tid), logprob=lp, bytes=list(self.bytes(tid)))

        return ChatLogprobs(
            content=[
                TokenLogprobEntry(
                    token=self.text(t.token_id),
                    logprob=t.logprob,
                    bytes=list(self.bytes(t.token_id)),
                    top_logprobs=[top(tid, lp) for tid, lp in t.top],
                )
                for t in lps
            ],
            refusal=None,
        )

    def legacy(
        self, lps: Sequence[TokenLogprob | None], ids: Sequence[int], offset: int
    ) -> CompletionLogprobs:
        """The completions shape for tokens `ids` (their logprobs, None where there is
        none: a prompt's first token); offsets count characters from `offset`."""
        tokens, values, tops, offsets = [], [], [], []
        for tid, lp in zip(ids, lps, strict=True):
            text = self.text(tid)
            tokens.append(text)
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self.text(i): v for i, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )


@attrs.define(kw_only=True)
class ChatAnswer(PieceWriter):
    encoder: Encoder
    id: str
    model: str
    created: int
    include_usage: bool
    choices: int
    service_tier: str | None
    spelling: Spelling | None  # when logprobs are asked for
    # How the output is read (apart from its reasoning, for calls).
    reading: Reading = attrs.field(factory=Reading)
    # Usage says how many tokens were reasoning (a model that can think, thinking or not).
    reasoning_usage: bool = False
    readers: dict[int, OutputReader] = attrs.field(factory=dict)  # per choice, streaming
    clock: Clock = attrs.field(factory=lambda: Clock(()))  # llama-server's timings

    def _chunk(
        self,
        choice: ChatChunkChoice | None,
        usage: OpenAIUsage | None = None,
        timings: LlamaTimings | None = None,
        progress: PromptProgressBody | None = None,
    ) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice] if choice is not None else [],
            usage=usage,
            service_tier=self.service_tier,
            timings=timings,
            prompt_progress=progress,
        )
        return self.encoder.sse(chunk)

    def progress(self, index: int, progress: PromptProgress) -> list[bytes]:
        """llama-server's progress chunk: an empty assistant delta with the progress."""
        choice = ChatChunkChoice(
            index=index, delta=ChatDelta(role="assistant"), logprobs=None, finish_reason=None
        )
        return [self._chunk(choice, progress=progress_body(progress))]

    def head(self) -> list[bytes]:
        return [
            self._chunk(
                ChatChunkChoice(
                    index=i,
                    delta=ChatDelta(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
            )
            for i in range(self.choices)
        ]

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        lps = None
        if self.spelling is not None and delta.logprobs:
            lps = self.spelling.chat(delta.logprobs)
        timings = self.clock.step(index, delta)
        if not self.reading.plain:
            reader = self._reader(index)
            frames = self.write(index, reader.feed(delta.text, len(delta.token_ids)))
            if lps is not None or timings is not None:
                choice = ChatChunkChoice(
                    index=index, delta=ChatDelta(), logprobs=lps, finish_reason=None
                )
                frames.append(self._chunk(choice, timings=timings))
            return frames
        if not delta.text and lps is None and timings is None:
            return []
        return [
            self._chunk(
                ChatChunkChoice(
                    index=index,
                    delta=ChatDelta(content=delta.text),
                    logprobs=lps,
                    finish_reason=None,
                ),
                timings=timings,
            )
        ]

    def _reader(self, index: int) -> OutputReader:
        if index not in self.readers:
            self.readers[index] = self.reading.reader()
        return self.readers[index]

    # A choice's reasoning, text and call pieces as chunks: a call's first carries its
    # id, type and name, the next ones its arguments as they are generated.

    def _part(self, choice: int, part: ChatDelta) -> list[bytes]:
        chunk = ChatChunkChoice(index=choice, delta=part, logprobs=None, finish_reason=None)
        return [self._chunk(chunk)]

    def on_reasoning(self, choice: int, text: str) -> list[bytes]:
        return self._part(choice, ChatDelta(reasoning_content=text))

    def on_text(self, choice: int, text: str) -> list[bytes]:
        return self._part(choice, ChatDelta(content=text))

    def on_call_start(self, choice: int, call: CallStart) -> list[bytes]:
        fn = FunctionCallDelta(name=call.name, arguments="")
        delta = ToolCallDelta(index=call.index, id=call_id(), type="function", function=fn)
        return self._part(choice, ChatDelta(tool_calls=[delta]))

    def on_call_args(self, choice: int, args: CallArgs) -> list[bytes]:
        fn = FunctionCallDelta(arguments=args.text)
        return self._part(
            choice, ChatDelta(tool_calls=[ToolCallDelta(index=args.index, function=fn)])
        )

    def on_call_end(self, choice: int, end: CallEnd) -> list[bytes]:
        return []

    def tail(self, outcome: Outcome) -> list[bytes]:
        frames = []
        reasoning = 0
        for c in outcome.choices:
            reason = chat_finish(c.finish.reason)
            if not self.reading.plain:
                reader = self._reader(c.index)
                frames += self.write(c.index, reader.finish())
                reasoning += reader.reasoning_tokens
                if self.reading.tools:
                    reason = chat_finish(c.finish.reason, reader.calls, reader.open_call)
            last = c.index == outcome.choices[-1].index and not self.include_usage
            frames.append(
                self._chunk(
                    ChatChunkChoice(
                        index=c.index, delta=ChatDelta(), logprobs=None, finish_reason=reason
                    ),
                    timings=final_timings(outcome) if last else None,
                )
            )
        if self.include_usage:
            usage = self._usage(outcome, reasoning)
            frames.append(self._chunk(None, usage, timings=final_timings(outcome)))
        return [*frames, _DONE]

    def _usage(self, outcome: Outcome, reasoning: int) -> OpenAIUsage:
        usage = _usage(outcome)
        if self.reasoning_usage:
            usage = attrs.evolve(
                usage, completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning)
            )
        return usage

    def _message(self, c: Choice) -> tuple[AssistantMessage, ChatFinish, int]:
        if self.reading.plain:
            return AssistantMessage(content=c.text, refusal=None), chat_finish(c.finish.reason), 0
        out = self.reading.read(c.text, c.token_ids)
        calls = [
            ToolCall(id=call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in out.calls
        ]
        message = AssistantMessage(
            content=out.text if out.has_text else None,
            refusal=None,
            tool_calls=calls or None,
            reasoning_content=out.reasoning or None,
        )
        reason = chat_finish(c.finish.reason)
        if self.reading.tools:
            reason = chat_finish(c.finish.reason, len(calls), out.truncated)
        return message, reason, out.reasoning_tokens

    def body(self, outcome: Outcome) -> bytes:
        choices = []
        reasoning = 0
        for c in outcome.choices:
            message, reason, thought = self._message(c)
            reasoning += thought
            lps = self.spelling.chat(c.logprobs) if self.spelling is not None else None
            choices.append(
                ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason)
            )
        return self.encoder.json(
            ChatCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=self._usage(outcome, reasoning),
                system_fingerprint=None,
                service_tier=self.service_tier,
                timings=final_timings(outcome),
            )
        )


@attrs.frozen
class EchoedPrompt:
    """A text completion's prompt as `echo` returns it: its text and token ids."""

    text: str
    ids: tuple[int, ...]


@attrs.define(kw_only=True)
class CompletionAnswer:
    encoder: Encoder
    id: str
    model: str
    created: int
    include_usage: bool
    choices: int
    prompts: tuple[EchoedPrompt, ...] | None  # per choice, when echo is asked for
    spelling: Spelling | None  # when logprobs are asked for
    # Characters already streamed per choice (logprobs' text offsets go on from there).
    sent: dict[int, int] = attrs.field(factory=dict)
    clock: Clock = attrs.field(factory=lambda: Clock(()))  # llama-server's timings

    def _chunk(
        self,
        choice: CompletionChunkChoice | None,
        usage: OpenAIUsage | None = None,
        timings: LlamaTimings | None = None,
        progress: PromptProgressBody | None = None,
    ) -> bytes:
        choices = [choice] if choice is not None else []
        chunk = CompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            timings=timings,
            prompt_progress=progress,
        )
        return self.encoder.sse(chunk)

    def progress(self, index: int, progress: PromptProgress) -> list[bytes]:
        """llama-server's progress chunk: an empty text with the progress."""
        choice = CompletionChunkChoice(index=index, text="", logprobs=None, finish_reason=None)
        return [self._chunk(choice, progress=progress_body(progress))]

    def _echo(
        self, index: int, scored: Sequence[TokenLogprob | None] | None
    ) -> tuple[str, CompletionLogprobs | None]:
        """The echoed prompt of a choice: its text and, with logprobs, its tokens'."""
        assert self.prompts is not None
        prompt = self.prompts[index]
        lps = None
        if self.spelling is not None:
            lps = self.spelling.legacy(scored or (None,) * len(prompt.ids), prompt.ids, 0)
        return prompt.text, lps

    def head(self) -> list[bytes]:
        return []

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        frames = []
        if index not in self.sent:  # the choice's first delta: its echo goes first
            self.sent[index] = 0
            if self.prompts is not None:
                text, lps = self._echo(index, delta.prompt_logprobs)
                self.sent[index] = len(text)
                frames.append(
                    self._chunk(
                        CompletionChunkChoice(
                            index=index, text=text, logprobs=lps, finish_reason=None
                        )
                    )
                )
        lps = None
        if self.spelling is not None and delta.logprobs:
            ids = [t.token_id for t in delta.logprobs]
            lps = self.spelling.legacy(delta.logprobs, ids, self.sent[index])
        timings = self.clock.step(index, delta)
        if delta.text or lps is not None or timings is not None:
            self.sent[index] += len(delta.text)
            frames.append(
                self._chunk(
                    CompletionChunkChoice(
                        index=index, text=delta.text, logprobs=lps, finish_reason=None
                    ),
                    timings=timings,
                )
            )
        return frames

    def tail(self, outcome: Outcome) -> list[bytes]:
        last = outcome.choices[-1].index
        frames = [
            self._chunk(
                CompletionChunkChoice(
                    index=c.index,
                    text="",
                    logprobs=None,
                    finish_reason=FINISH[c.finish.reason].openai,
                ),
                timings=(
                    final_timings(outcome) if c.index == last and not self.include_usage else None
                ),
            )
            for c in outcome.choices
        ]
        if self.include_usage:
            frames.append(self._chunk(None, _usage(outcome), timings=final_timings(outcome)))
        return [*frames, _DONE]

    def _choice(self, c: Choice) -> CompletionChoice:
        text, lps = c.text, None
        prefix, prefix_lps = "", None
        if self.prompts is not None:
            prefix, prefix_lps = self._echo(c.index, c.prompt_logprobs)
        if self.spelling is not None:
            ids = [t.token_id for t in c.logprobs]
            lps = self.spelling.legacy(c.logprobs, ids, len(prefix))
            if prefix_lps is not None:
                lps = CompletionLogprobs(
                    tokens=prefix_lps.tokens + lps.tokens,
                    token_logprobs=prefix_lps.token_logprobs + lps.token_logprobs,
                    top_logprobs=prefix_lps.top_logprobs + lps.top_logprobs,
                    text_offset=prefix_lps.text_offset + lps.text_offset,
                )
        return CompletionChoice(
            index=c.index,
            text=prefix + text,
            logprobs=lps,
            finish_reason=FINISH[c.finish.reason].openai,
        )

    def body(self, outcome: Outcome) -> bytes:
        return self.encoder.json(
            Completion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[self._choice(c) for c in outcome.choices],
                usage=_usage(outcome),
                system_fingerprint=None,
                timings=final_timings(outcome),
            )
        )


def _sampling(
    req: ChatRequest | CompletionRequest,
    vocab_size: int,
    grammar: str | CompiledGrammar | None = None,
) -> SamplingRequest:
    return SamplingRequest(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=logit_bias_pairs(req.logit_bias, vocab_size),
        grammar=grammar,
        repeat_penalty=req.repeat_penalty,
        repeat_last_n=req.repeat_last_n,
        samplers=tuple(req.samplers) if req.samplers is not None else None,
    )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class _OpenAIFrontend(Frontend):
    protocol = "openai"
    dialect = OpenAIDialect()
    unversioned = True

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = OpenAICodec()
        self._spelling = Spelling(ctx.model.tokenizer)

    def _choices(
        self,
        req: ChatRequest | CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        *,
        prompt_param: str,
        logprobs: int | None,
        sampling: SamplingRequest,
        grant: Grant | None = None,
        requested: int | None = None,
        param: str = "max_tokens",
        prompt_logprobs: int | None = None,
    ) -> tuple[tuple[GenerationRequest, ...], tuple[int, ...], tuple[tuple[bytes, bytes], ...]]:
        """The engine requests of every choice (n per prompt, in OpenAI's index order),
        the prompt each continues, and the clamp header. `grant`: the budget a chat's
        one prompt got from the chat pipeline; else each prompt's is checked here."""
        n = req.n or 1
        requests: list[GenerationRequest] = []
        groups: list[int] = []
        clamped: list[Grant] = []
        for group, ids in enumerate(prompts):
            got = grant
            if got is None:
                got = self.budget.grant(
                    len(ids), requested, param=param, prompt_param=prompt_param, clamp=True
                )
            gen, _warnings = self.generation(
                request_id,
                ids,
                got,
                sampling=sampling,
                stop=_stops(req.stop),
                ignore_eos=bool(req.ignore_eos),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            if got.clamped_from is not None:
                clamped.append(got)
            for k in range(n):
                requests.append(_sibling(gen, k))
                groups.append(group)
        self.check_fits(requests, param="n" if n > 1 else prompt_param)
        headers = clamp_headers(min(clamped, key=lambda g: g.max_new_tokens)) if clamped else ()
        return tuple(requests), tuple(groups), headers

    def _check_n(
        self, req: ChatRequest | CompletionRequest, prompts: int, *, prompt_param: str
    ) -> None:
        """`n` times the prompts against what the server decodes at once (a chat's is
        checked before its template is rendered)."""
        n = req.n or 1
        limit = self.ctx.config.max_concurrency
        if n * prompts > limit:
            raise ApiError(
                "invalid_request",
                f"{n * prompts} sequences were asked for (n times the prompts); this "
                f"server decodes at most {limit} at once (--max-concurrency)",
                param="n" if n > 1 else prompt_param,
                code="invalid_value",
            )

    def _prepared(
        self,
        req: ChatRequest | CompletionRequest,
        requests: tuple[GenerationRequest, ...],
        groups: tuple[int, ...],
        headers: tuple[tuple[bytes, bytes], ...],
        answer: ChatAnswer | CompletionAnswer,
        log_fields: dict[str, Any],
    ) -> Prepared:
        if req.stream and req.return_progress:  # llama-server's prompt_progress chunks
            requests = tuple(attrs.evolve(r, progress=True) for r in requests)
        return Prepared(
            requests=requests,
            stream=bool(req.stream),
            answer=answer,
            log_fields=log_fields,
            prompt_of=groups,
            headers=headers,
        )

    def _include_usage(self, req: ChatRequest | CompletionRequest) -> bool:
        return bool(req.stream_options and req.stream_options.include_usage)


def _clock(req: ChatRequest | CompletionRequest, requests: Sequence[GenerationRequest]) -> Clock:
    """The answer's running timings (sent with every token with `timings_per_token`)."""
    return Clock(tuple(len(r.prompt_ids) for r in requests), bool(req.timings_per_token))


def _sibling(gen: GenerationRequest, k: int) -> GenerationRequest:
    """The k-th sequence of a prompt: a seeded request's k-th gets seed + k, so that n
    seeded choices differ from each other and are each reproducible."""
    seed = gen.sampling.seed
    if k == 0 or seed is None or gen.sampling.greedy:
        return gen
    return attrs.evolve(gen, sampling=attrs.evolve(gen.sampling, seed=(seed + k) % 2**63))


def _format_schema(req: ChatRequest) -> tuple[dict[str, Any] | None, str]:
    """response_format as the schema the output must match (None: free text), and where
    it is in the request."""
    if req.json_schema is not None:  # llama-server's field
        return req.json_schema, "json_schema"
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.schema is not None:  # llama-server's shape (checked by the codec)
        return fmt.schema, "response_format.schema"
    if fmt.type == "json_object":
        return ANY_JSON_OBJECT, "response_format"
    assert fmt.json_schema is not None  # checked by the codec
    schema = fmt.json_schema.get("schema")
    return (schema if schema is not None else ANY_JSON_OBJECT), "response_format.json_schema.schema"


def _chat_call(req: ChatRequest) -> ChatCall:
    """A chat completion in the chat pipeline's words."""
    schema, where = _format_schema(req)
    requested, param = req.requested_tokens("max_completion_tokens", "max_tokens")
    return ChatCall(
        model=req.model,
        conversation=[_turn(m) for m in req.messages],
        plan=lambda: _tool_plan(req),
        thinking=_chat_thinking(req),
        schema=schema,
        schema_param=where,
        requested=requested,
        budget_param=param,
    )


def _tool_plan(req: ChatRequest) -> ToolPlan | None:
    """The request's functions and choice (checked by the codec), or None without tools."""
    if not req.tools:
        return None
    tools = tuple(
        Tool.checked(
            t.function.name,
            t.function.description,
            t.function.parameters,
            f"tools[{i}].function.parameters",
        )
        for i, t in enumerate(req.tools)
        if t.function is not None  # checked by the codec
    )
    return ToolPlan.of(tools, req.tool_choice, req.parallel_tool_calls is not False)


def _turn(m: ChatMessage) -> dict[str, Any]:
    """A message as a turn of the conversation (calls and results included)."""
    turn: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        turn["tool_calls"] = [
            ToolCallTurn(c.id, c.function.name, replayed_arguments(c.function.arguments, ""))
            for c in m.tool_calls
            if c.function is not None
        ]
    if m.role == "tool":
        turn["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        turn["reasoning_content"] = m.reasoning_content
    return turn


def _chat_thinking(req: ChatRequest) -> ThinkingAsk:
    """What a chat request asks of thinking: chat_template_kwargs' switches, else
    reasoning_effort (none: off; any other effort: on). The codec checked they agree."""
    kwargs = req.chat_template_kwargs or {}
    enabled, param = kwargs.get("enable_thinking"), "chat_template_kwargs.enable_thinking"
    if enabled is None and req.reasoning_effort is not None:
        enabled, param = req.reasoning_effort != "none", "reasoning_effort"
    return ThinkingAsk(
        enabled, kwargs.get("preserve_thinking"), param, "chat_template_kwargs.preserve_thinking"
    )


class ChatFrontend(_OpenAIFrontend):
    endpoint = "/v1/chat/completions"

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        # llama-server's /apply-template: a chat body rendered as the chat route renders
        # it (tools, thinking), its prompt answered instead of generated from.
        return (*super().routes(), FrontendRoute("/apply-template", {"POST": Count(cls.apply)}))

    async def apply(self, body: bytes) -> bytes:
        """{"prompt": the text the chat route would tokenize for `body`}."""
        req = await self.decode(body, self._codec.parse_chat)
        first = await chat_prompt(self, _chat_call(req))
        text = self.ctx.model.tokenizer.chat_prompt(first.prompt)
        return self.dialect.encoder.json(AppliedTemplate(prompt=text))

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_chat)
        # OpenAI's own checks first: n, and the sampling fields (logit_bias's ids).
        self._check_n(req, 1, prompt_param="messages")
        sampling = _sampling(req, self.ctx.model.identity.vocab_size, None)
        chat = await prepare_chat(self, _chat_call(req))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        requests, groups, headers = self._choices(
            req,
            request_id,
            [chat.ids],
            grant=chat.grant,
            prompt_param="messages",
            logprobs=logprobs,
            sampling=attrs.evolve(sampling, grammar=chat.grammar),
        )
        answer = ChatAnswer(
            encoder=self.dialect.encoder,
            id="chatcmpl-" + request_id,
            model=chat.model,  # the served name the client used (an alias answered as sent)
            created=int(time.time()),  # OpenAI's `created`: when this completion was made
            include_usage=self._include_usage(req),
            choices=len(requests),
            service_tier=_tier(req.service_tier),
            spelling=self._spelling if logprobs is not None else None,
            reading=chat.reading,
            reasoning_usage=chat.thinking is not None,
            clock=_clock(req, requests),
        )
        return self._prepared(req, requests, groups, headers, answer, chat.log_fields)


class CompletionsFrontend(_OpenAIFrontend):
    endpoint = "/v1/completions"

    # OpenAI's legacy default for text completions is 16 tokens.
    DEFAULT_MAX_TOKENS = 16

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_completion)
        model = self.ctx.check_model(req.model)
        prompts: list[list[int]] = []
        texts: list[str] = []
        for i, prompt in enumerate(req.prompts()):
            where = "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]"
            if isinstance(prompt, str):
                prompts.append(await self.tokens(prompt, prompt_param=where))
                texts.append(prompt)
            else:  # (negative ids were refused by the codec)
                texts.append(self.id_prompt(prompt, where))
                prompts.append(prompt)
        requested, param = req.requested_tokens("max_tokens")
        if req.max_tokens is None and req.n_predict is None:
            requested = self.DEFAULT_MAX_TOKENS
        logprobs = req.logprobs
        self._check_n(req, len(prompts), prompt_param="prompt")
        requests, groups, headers = self._choices(
            req,
            request_id,
            prompts,
            requested=requested,
            param=param,
            prompt_param="prompt",
            logprobs=logprobs,
            prompt_logprobs=logprobs if req.echo and logprobs is not None else None,
            sampling=_sampling(req, self.ctx.model.identity.vocab_size, None),
        )
        echoed = None
        if req.echo:
            echoed = tuple(EchoedPrompt(texts[g], tuple(prompts[g])) for g in groups)
        answer = CompletionAnswer(
            encoder=self.dialect.encoder,
            id="cmpl-" + request_id,
            model=model,
            created=int(time.time()),
            include_usage=self._include_usage(req),
            choices=len(requests),
            prompts=echoed,
            spelling=self._spelling if logprobs is not None else None,
            clock=_clock(req, requests),
        )
        return self._prepared(req, requests, groups, headers, answer, self.log_fields())
