"""The OpenAI Responses core as a frontend: POST /v1/responses (a body, or semantic SSE
events), the local store behind `previous_response_id` and the stored-response routes,
and the token count of POST /v1/responses/input_tokens.

A Response's conversation is its stored history (the earlier input and output Items of
its chain, never their `instructions`) followed by its own input; the request's
`instructions` come first, for this request only. Stored Responses live in this
process: an LRU bounded by count and by the bytes of their texts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from ninfer.engine import TokenDelta
from ninfer.frontends._base import (
    Count,
    Frontend,
    FrontendContext,
    FrontendRoute,
    Look,
    Outcome,
    PathArgs,
    Prepared,
)
from ninfer.frontends._chat import ChatCall, chat_prompt, prepare_chat
from ninfer.frontends._finish import FINISH
from ninfer.frontends._output import OutputReader, PieceWriter, Reading
from ninfer.frontends._reasoning import ThinkingAsk
from ninfer.frontends._response_store import (
    Item,
    ResponseStore,
    Stored,
    Turn,
    input_item_page,
    not_found,
    stored_size,
)
from ninfer.frontends._sampling import SamplingRequest
from ninfer.frontends._structured import ANY_JSON_OBJECT
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
    ContentPartEvent,
    Encoder,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputMessage,
    InputText,
    InputTokensCount,
    InputTokensDetails,
    InputTokensRequest,
    OpenAIDialect,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseDeleted,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesCodec,
    ResponsesInputItem,
    ResponsesReasoning,
    ResponsesRequest,
    ResponsesTextFormat,
    ResponsesTool,
    ResponseTextConfig,
    ResponseTextFormat,
    ResponseUsage,
    replayed_arguments,
)

__all__ = ["ResponseStore", "ResponsesFrontend"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_text(text: str) -> OutputText:
    return OutputText(text=text, annotations=[], logprobs=[])


def _input_items(items: str | list[ResponsesInputItem]) -> list[Item]:
    """The request's input as stored Items (a string is one user message; ids kept or
    made)."""
    if isinstance(items, str):
        return [InputMessage(id=_new_id("msg"), role="user", content=[InputText(text=items)])]
    out: list[Item] = []
    for item in items:
        if item.type == "reasoning":
            texts = [
                ReasoningText(text=p.text or "")
                for p in item.content or ()
                if not isinstance(p, str)
            ]
            out.append(
                ReasoningItem(
                    id=item.id or _new_id("rs"),
                    summary=list(item.summary or []),
                    content=texts,
                    status="completed",
                )
            )
            continue
        if item.type == "function_call":
            assert item.call_id
            assert item.name
            assert item.arguments is not None
            out.append(
                FunctionCallItem(
                    id=item.id or _new_id("fc"),
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                    status="completed",
                )
            )
            continue
        if item.type == "function_call_output":
            assert item.call_id
            assert item.output is not None
            output = (
                item.output
                if isinstance(item.output, str)
                else "".join(p.text or "" for p in item.output)
            )
            out.append(
                FunctionCallOutputItem(
                    id=item.id or _new_id("fco"),
                    call_id=item.call_id,
                    output=output,
                    status="completed",
                )
            )
            continue
        assert item.role is not None  # the codec checked both
        assert item.content is not None
        parts: list[InputText | OutputText]
        if isinstance(item.content, str):
            text = item.content
            parts = [_output_text(text) if item.role == "assistant" else InputText(text=text)]
        else:
            parts = [
                _output_text(p.text or "")
                if p.type == "output_text"
                else InputText(text=p.text or "")
                for p in item.content
            ]
        role: Any = item.role
        out.append(InputMessage(id=item.id or _new_id("msg"), role=role, content=parts))
    return out


def _check_outputs_answer_calls(earlier: Sequence[Turn], items: Sequence[Item]) -> None:
    """Each function_call_output answers a call made before it: in the chain continued,
    or by a function_call Item earlier in the input (as OpenAI checks)."""
    made = {c.id for t in earlier for c in t.calls}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            made.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in made:
            raise ApiError(
                "invalid_request",
                f"input[{i}] is the output of a function call that was not made (no "
                "function_call with its call_id before it, nor in the previous response)",
                param=f"input[{i}].call_id",
                code="invalid_value",
            )


def _turns(items: Sequence[Item]) -> list[Turn]:
    """Items as turns: function calls join the assistant turn just before them (or make
    one), outputs are tool turns; reasoning Items are the reasoning of the assistant turn
    (message or calls) that follows them."""
    turns: list[Turn] = []
    pending: list[str] = []  # reasoning not yet given to an assistant turn
    for item in items:
        if isinstance(item, ReasoningItem):
            pending.append("".join(p.text for p in item.content))
            continue
        thought = "\n\n".join(pending) if pending else None
        pending = []
        if isinstance(item, InputMessage):
            text = "".join(p.text for p in item.content)
            turns.append(
                Turn(item.role, text, reasoning=thought if item.role == "assistant" else None)
            )
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(Turn("tool", item.output, call_id=item.call_id))
        else:
            call = ToolCallTurn(item.call_id, item.name, replayed_arguments(item.arguments, ""))
            if turns and turns[-1].role == "assistant" and thought is None:
                turns[-1] = attrs.evolve(turns[-1], calls=(*turns[-1].calls, call))
            else:
                turns.append(Turn("assistant", "", (call,), reasoning=thought))
    return turns


Streamed = ReasoningItem | OutputMessage | FunctionCallItem  # an output Item


@attrs.define(kw_only=True)
class ResponseAnswer(PieceWriter):
    """One Response's answer: a body, or semantic events numbered in order. A finished
    Response (completed or incomplete) is stored when the request asked for it."""

    encoder: Encoder
    store: ResponseStore | None  # None: store was false
    template: ResponseObject  # the in-progress Response: every field but the outcome's
    input_items: tuple[Item, ...]
    history: tuple[Turn, ...]  # what this request continued (its chain's), then its input
    # How the output is read (apart from its reasoning, for calls).
    reading: Reading = attrs.Factory(Reading)
    item_id: str = attrs.Factory(lambda: _new_id("msg"))
    sequence: int = 0
    reader: OutputReader | None = None  # streaming, unless plain
    # A stream's output Items so far (thinking or with tools, each opens as the output
    # shows what it is): the reasoning, the message's text, each call's Item and
    # arguments.
    streamed: list[Streamed] = attrs.Factory(list)
    text: list[str] = attrs.Factory(list)
    thought: list[str] = attrs.Factory(list)
    arguments: list[str] = attrs.Factory(list)

    def _sse(self, event: Any) -> bytes:
        return self.encoder.sse(event, event.type)

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def head(self) -> list[bytes]:
        frames = [
            self._sse(
                ResponseLifecycleEvent(
                    type="response.created", sequence_number=self._next(), response=self.template
                )
            ),
            self._sse(
                ResponseLifecycleEvent(
                    type="response.in_progress",
                    sequence_number=self._next(),
                    response=self.template,
                )
            ),
        ]
        if self.reading.plain:
            frames += self._open_message()
        else:
            self.reader = self.reading.reader()
        return frames

    # ---- a stream's output Items: each opens as the output shows what it is ----

    def _open(self, item: Streamed, part: OutputText | ReasoningText | None) -> list[bytes]:
        """The Item being streamed ends, and `item` begins (with its one content part)."""
        frames = self._close("completed")
        self.streamed.append(item)
        at = len(self.streamed) - 1
        added = OutputItemEvent(
            type="response.output_item.added",
            sequence_number=self._next(),
            output_index=at,
            item=item,
        )
        frames.append(self._sse(added))
        if part is not None:
            frames.append(self._sse(self._part("response.content_part.added", part)))
        return frames

    def _open_message(self) -> list[bytes]:
        item = OutputMessage(id=self.item_id, status="in_progress", content=[])
        return self._open(item, _output_text(""))

    def _part(
        self,
        event: Literal["response.content_part.added", "response.content_part.done"],
        part: OutputText | ReasoningText,
    ) -> ContentPartEvent:
        at = len(self.streamed) - 1
        return ContentPartEvent(
            type=event,
            sequence_number=self._next(),
            item_id=self.streamed[at].id,
            output_index=at,
            content_index=0,
            part=part,
        )

    def _done(
        self, event: Any, item: Streamed, part: OutputText | ReasoningText | None
    ) -> list[bytes]:
        """The frames that end the Item being streamed as `item`: its own done `event`,
        its content part's, the Item's."""
        at = len(self.streamed) - 1
        self.streamed[at] = item
        frames = [self._sse(event)]
        if part is not None:
            frames.append(self._sse(self._part("response.content_part.done", part)))
        done = OutputItemEvent(
            type="response.output_item.done",
            sequence_number=self._next(),
            output_index=at,
            item=item,
        )
        return [*frames, self._sse(done)]

    def _open_kind(self) -> str | None:
        last = self.streamed[-1] if self.streamed else None
        return None if last is None or last.status != "in_progress" else last.type

    def _close(self, status: Literal["completed", "incomplete"]) -> list[bytes]:
        """The frames that end the Item being streamed, if one is."""
        kind = self._open_kind()
        if kind is None:
            return []
        at = len(self.streamed) - 1
        open_id = self.streamed[at].id
        if kind == "reasoning":
            part = ReasoningText(text="".join(self.thought))
            thinking = ReasoningItem(id=open_id, summary=[], content=[part], status=status)
            done: Any = ReasoningTextDoneEvent(
                sequence_number=self._next(),
                item_id=open_id,
                output_index=at,
                content_index=0,
                text=part.text,
            )
            return self._done(done, thinking, part)
        if kind == "message":
            text = _output_text("".join(self.text))
            done = OutputTextDoneEvent(
                sequence_number=self._next(),
                item_id=open_id,
                output_index=at,
                content_index=0,
                text=text.text,
                logprobs=[],
            )
            message = OutputMessage(id=open_id, status=status, content=[text])
            return self._done(done, message, text)
        call = self.streamed[at]
        assert isinstance(call, FunctionCallItem)
        args = "".join(self.arguments)
        done = FunctionCallArgumentsDoneEvent(
            sequence_number=self._next(),
            item_id=open_id,
            output_index=at,
            name=call.name,
            arguments=args,
        )
        return self._done(done, attrs.evolve(call, arguments=args, status=status), None)

    def on_reasoning(self, choice: int, text: str) -> list[bytes]:
        frames = []
        if self._open_kind() != "reasoning":
            item = ReasoningItem(id=_new_id("rs"), summary=[], content=[], status="in_progress")
            frames = self._open(item, ReasoningText(text=""))
            self.thought = []
        self.thought.append(text)
        at = len(self.streamed) - 1
        event = ReasoningTextDeltaEvent(
            sequence_number=self._next(),
            item_id=self.streamed[at].id,
            output_index=at,
            content_index=0,
            delta=text,
        )
        return [*frames, self._sse(event)]

    def on_text(self, choice: int, text: str) -> list[bytes]:
        frames = []
        if self._open_kind() != "message":  # after reasoning or a call, a new message Item
            frames = self._open_message()
        self.text.append(text)
        event = OutputTextDeltaEvent(
            sequence_number=self._next(),
            item_id=self.item_id,
            output_index=len(self.streamed) - 1,
            content_index=0,
            delta=text,
            logprobs=[],
        )
        return [*frames, self._sse(event)]

    def on_call_start(self, choice: int, call: CallStart) -> list[bytes]:
        self.arguments = []
        item = FunctionCallItem(
            id=_new_id("fc"), call_id=call_id(), name=call.name, arguments="", status="in_progress"
        )
        return self._open(item, None)

    def on_call_args(self, choice: int, args: CallArgs) -> list[bytes]:
        self.arguments.append(args.text)
        at = len(self.streamed) - 1
        delta = FunctionCallArgumentsDeltaEvent(
            sequence_number=self._next(),
            item_id=self.streamed[at].id,
            output_index=at,
            delta=args.text,
        )
        return [self._sse(delta)]

    def on_call_end(self, choice: int, end: CallEnd) -> list[bytes]:
        return self._close("completed")

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        if self.reader is not None:
            return self.write(0, self.reader.feed(delta.text, len(delta.token_ids)))
        if not delta.text:
            return []
        return self.on_text(0, delta.text)

    def _output(
        self, outcome: Outcome, status: Literal["completed", "incomplete"]
    ) -> tuple[list[ReasoningItem | OutputMessage | FunctionCallItem], int]:
        """The output Items of a body (a stream's are those it sent), and how many
        output tokens were reasoning."""
        if self.reading.plain:
            text = [_output_text(outcome.text)]
            return [OutputMessage(id=self.item_id, status=status, content=text)], 0
        choice = outcome.choices[0]
        out = self.reading.read(choice.text, choice.token_ids)
        items: list[ReasoningItem | OutputMessage | FunctionCallItem] = []
        if out.reasoning:
            part = ReasoningText(text=out.reasoning)
            items.append(ReasoningItem(id=_new_id("rs"), summary=[], content=[part], status=status))
        if out.has_text:
            items.append(
                OutputMessage(id=self.item_id, status=status, content=[_output_text(out.text)])
            )
        items += [
            FunctionCallItem(
                id=_new_id("fc"),
                call_id=call_id(),
                name=c.name,
                arguments=c.arguments,
                status="completed",
            )
            for c in out.calls
        ]
        return items, out.reasoning_tokens

    def _finished(self, outcome: Outcome, streamed: bool = False) -> ResponseObject:
        f = outcome.finish
        u = outcome.usage
        complete = FINISH[f.reason].complete
        status: Literal["completed", "incomplete"] = "completed" if complete else "incomplete"
        if streamed:
            output = list(self.streamed)
            reasoning = self.reader.reasoning_tokens if self.reader is not None else 0
        else:
            output, reasoning = self._output(outcome, status)
        usage = ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
            output_tokens=u.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=u.prompt_tokens + u.completion_tokens,
        )
        response = attrs.evolve(
            self.template,
            status=status,
            completed_at=int(time.time()),
            output=output,
            usage=usage,
            incomplete_details=None if complete else IncompleteDetails(),
        )
        if self.store is not None:
            history = (*self.history, _reply(output))
            size = stored_size(self.encoder, response, self.input_items, history)
            self.store.put(Stored(response, self.input_items, history, size))
        return response

    def tail(self, outcome: Outcome) -> list[bytes]:
        complete = FINISH[outcome.finish.reason].complete
        frames = self.write(0, self.reader.finish()) if self.reader is not None else []
        if not any(i.type != "reasoning" for i in self.streamed):  # no text, no call: the
            frames += self._open_message()  # (empty) message still is one
        frames += self._close("completed" if complete else "incomplete")
        response = self._finished(outcome, streamed=True)
        end: Literal["response.completed", "response.incomplete"] = (
            "response.completed" if response.status == "completed" else "response.incomplete"
        )
        return [
            *frames,
            self._sse(
                ResponseLifecycleEvent(type=end, sequence_number=self._next(), response=response)
            ),
        ]

    def body(self, outcome: Outcome) -> bytes:
        return self.encoder.json(self._finished(outcome))

    def failed(self, err: ApiError) -> list[bytes]:
        """A stream that fails after it began ends with response.failed (nothing stored)."""
        code = err.code or err.kind
        response = attrs.evolve(
            self.template, status="failed", error=ResponseError(code=code, message=err.message)
        )
        return [
            self._sse(
                ResponseLifecycleEvent(
                    type="response.failed", sequence_number=self._next(), response=response
                )
            )
        ]


def _reply(output: Sequence[ReasoningItem | OutputMessage | FunctionCallItem]) -> Turn:
    """A Response's output as the assistant turn a continuation replays (a call the
    budget cut short, streamed as an incomplete Item, is left out: its arguments do not
    parse), with its reasoning."""
    text = "".join(p.text for i in output if isinstance(i, OutputMessage) for p in i.content)
    calls = tuple(
        ToolCallTurn(i.call_id, i.name, replayed_arguments(i.arguments, ""))
        for i in output
        if isinstance(i, FunctionCallItem) and i.status == "completed"
    )
    thoughts = ["".join(p.text for p in i.content) for i in output if isinstance(i, ReasoningItem)]
    return Turn("assistant", text, calls, reasoning="\n\n".join(thoughts) if thoughts else None)


class ResponsesFrontend(Frontend):
    endpoint = "/v1/responses"
    protocol = "openai"
    dialect = OpenAIDialect()
    unversioned = True

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = ResponsesCodec()
        cfg = ctx.config
        self.store = ResponseStore(
            cfg.response_store_max_records, int(cfg.response_store_max_mib * 1024 * 1024)
        )

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        one = "/v1/responses/{response_id}"
        return (
            *super().routes(),
            FrontendRoute("/v1/responses/input_tokens", {"POST": Count(cls.input_tokens)}),
            FrontendRoute("/v1/responses/compact", {"POST": Look(cls.compact)}),
            FrontendRoute(one, {"GET": Look(cls.retrieve), "DELETE": Look(cls.delete)}),
            FrontendRoute(one + "/input_items", {"GET": Look(cls.input_items)}),
            FrontendRoute(one + "/cancel", {"POST": Look(cls.cancel)}),
        )

    def _history(self, previous_id: str | None) -> tuple[Turn, ...]:
        if previous_id is None:
            return ()
        stored = self.store.get(previous_id)
        if stored is None:
            raise not_found("previous_response_id")
        return stored.history

    def _chat_call(
        self,
        req: ResponsesRequest | InputTokensRequest,
        history: Sequence[Turn],
        requested: int | None,
    ) -> ChatCall:
        """A Responses request (or a count of one) in the chat pipeline's words: its
        instructions, then the conversation it continues and its input (`history`)."""
        conversation: list[dict[str, Any]] = []
        if req.instructions is not None:
            conversation.append({"role": "system", "content": req.instructions})
        conversation.extend(t.message() for t in history)
        tools = _tools(req.tools)
        parallel = req.parallel_tool_calls is not False
        schema, where = _format_schema(req.text.format if req.text else None)
        return ChatCall(
            model=req.model,
            conversation=conversation,
            plan=lambda: ToolPlan.of(tools, req.tool_choice, parallel) if tools else None,
            thinking=_thinking_ask(req.reasoning),
            schema=schema,
            schema_param=where,
            requested=requested,
            budget_param="max_output_tokens",
            prompt_param="input",
        )

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_create)
        items = tuple(_input_items(req.input))
        earlier = self._history(req.previous_response_id)
        _check_outputs_answer_calls(earlier, items)
        history = (*earlier, *_turns(items))
        store = req.store is not False
        chat = await prepare_chat(
            self,
            self._chat_call(req, history, req.max_output_tokens),
            store=store,
            previous_response_id=req.previous_response_id,
        )
        gen, _warnings = self.generation(
            request_id,
            chat.ids,
            chat.grant,
            sampling=SamplingRequest(
                temperature=req.temperature, top_p=req.top_p, grammar=chat.grammar
            ),
            stop=(),
        )
        template = self._template(
            req, chat.model, gen.sampling.temperature, gen.sampling.top_p, store
        )
        if store:
            self._check_room(template, items, history, chat.grant.max_new_tokens)
        answer = ResponseAnswer(
            encoder=self.dialect.encoder,
            store=self.store if store else None,
            template=template,
            input_items=items,
            history=history,
            reading=chat.reading,
        )
        return self.prepared(
            gen, chat.grant, stream=bool(req.stream), answer=answer, log_fields=chat.log_fields
        )

    def _check_room(
        self,
        template: ResponseObject,
        items: Sequence[Item],
        history: Sequence[Turn],
        max_new_tokens: int,
    ) -> None:
        """Refuse at once a Response the store could not keep even alone (its output at
        its longest, counted twice: in the Response and in the history), rather than
        pretend it was stored."""
        most = (
            stored_size(self.dialect.encoder, template, items, history)
            + 2 * max_new_tokens * self.ctx.model.tokenizer.max_token_bytes
        )
        if most > self.store.max_bytes:
            raise ApiError(
                "invalid_request",
                f"this response could take {most} bytes to store; the store holds "
                f"{self.store.max_bytes} (send store: false, or a smaller max_output_tokens)",
                param="store",
                code="response_store_capacity_exceeded",
            )

    def _template(
        self, req: ResponsesRequest, label: str, temperature: float, top_p: float, store: bool
    ) -> ResponseObject:
        return ResponseObject(
            id=_new_id("resp"),
            object="response",
            created_at=int(time.time()),
            status="in_progress",
            completed_at=None,
            model=label,
            output=[],
            usage=None,
            incomplete_details=None,
            error=None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=dict(req.metadata or {}),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=store,
            temperature=temperature,
            top_p=top_p,
            top_logprobs=0,
            text=ResponseTextConfig(format=_echoed_format(req)),
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=[
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": bool(t.strict),
                }
                for t in req.tools or ()
            ],
            truncation="disabled",
            service_tier="default",
            background=False,
        )

    # ---- the other routes of /v1/responses -----------------------------------------------

    def retrieve(self, call: PathArgs) -> bytes:
        stored = self.store.get(call.params["response_id"])
        if stored is None:
            raise not_found()
        return self.dialect.encoder.json(stored.response)

    def delete(self, call: PathArgs) -> bytes:
        response_id = call.params["response_id"]
        if not self.store.delete(response_id):
            raise not_found()
        return self.dialect.encoder.json(ResponseDeleted(id=response_id, deleted=True))

    def input_items(self, call: PathArgs) -> bytes:
        """GET /v1/responses/{id}/input_items (`input_item_page`)."""
        stored = self.store.get(call.params["response_id"])
        if stored is None:
            raise not_found()
        return self.dialect.encoder.json(input_item_page(stored, call.query))

    def cancel(self, call: PathArgs) -> bytes:
        """POST /v1/responses/{id}/cancel: always refused."""
        raise ApiError(
            "bad_request",
            "responses are not run in the background here, so there is nothing to cancel; "
            "close the connection to cancel a response being generated",
            code="background_not_supported",
        )

    def compact(self, call: PathArgs) -> bytes:
        """POST /v1/responses/compact: always refused."""
        raise ApiError(
            "bad_request",
            "conversation compaction is not supported by this server",
            code="compaction_not_supported",
        )

    async def input_tokens(self, body: bytes) -> bytes:
        """POST /v1/responses/input_tokens: the prompt /v1/responses would build, counted."""
        req = await self.decode(body, self._codec.parse_input_tokens)
        items = _input_items(req.input) if req.input is not None else []
        history = (*self._history(req.previous_response_id), *_turns(items))
        if not history:
            raise ApiError(
                "invalid_request",
                "input is required (or a previous_response_id to count)",
                param="input",
                code="missing_required_parameter",
            )
        first = await chat_prompt(self, self._chat_call(req, history, None))
        return self.dialect.encoder.json(InputTokensCount(input_tokens=len(first.ids)))


def _thinking_ask(reasoning: ResponsesReasoning | None) -> ThinkingAsk:
    """`reasoning.effort`: none turns thinking off, any other effort on."""
    effort = reasoning.effort if reasoning is not None else None
    return ThinkingAsk(None if effort is None else effort != "none", None, "reasoning.effort")


def _tools(tools: Sequence[ResponsesTool] | None) -> tuple[Tool, ...]:
    return tuple(
        Tool.checked(t.name, t.description, t.parameters, f"tools[{i}].parameters")
        for i, t in enumerate(tools or ())
        if t.name is not None  # checked by the codec
    )


def _format_schema(fmt: ResponsesTextFormat | None) -> tuple[dict[str, Any] | None, str]:
    """`text.format` as the schema the output must match (as chat's response_format;
    None: free text), and where it is in the request."""
    if fmt is None or fmt.type == "text":
        return None, "text.format"
    if fmt.type == "json_object" or fmt.schema is None:
        return ANY_JSON_OBJECT, "text.format"
    return fmt.schema, "text.format.schema"


def _echoed_format(req: ResponsesRequest) -> ResponseTextFormat:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return ResponseTextFormat(type="text")
    if fmt.type == "json_object":
        return ResponseTextFormat(type="json_object")
    return ResponseTextFormat(
        type="json_schema",
        name=fmt.name,
        schema=fmt.schema if fmt.schema is not None else ANY_JSON_OBJECT,
        strict=fmt.strict,
        description=fmt.description,
    )
