"""What every frontend is and shares.

A frontend is one protocol's routes (`Routed`): declared by its class, so the app's
route table exists before the model loads, and served by the instance built once the
model is ready. A route is answered by the request flow (`Generate`), as a token count
(`Count`) or from what the frontend holds (`Look`).

A generation frontend (`Frontend`) owns its codec, its chat template and limits, and
the shape of its answers: `prepare(body, request_id)` parses and checks the body,
renders and tokenizes the prompt, resolves the budget and sampling, and returns a
`Prepared` whose `answer` writes this request's body or stream frames. Its `dialect`
writes its refusals. The request flow (`ninfer._flow`) drives any frontend the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import (
    ChatText,
    CompiledGrammar,
    Finish,
    GenerationRequest,
    PromptProgress,
    ServedModel,
    TokenDelta,
    TokenLogprob,
    Usage,
    opens_thinking,
)
from ninfer.frontends._budget import Budget, Grant
from ninfer.frontends._grammar import GrammarCompiler
from ninfer.frontends._output import Reading
from ninfer.frontends._reasoning import (
    ThinkingAsk,
    ThinkingMode,
    close_unwanted_thinking,
    resolve_thinking,
)
from ninfer.frontends._sampling import SamplingRequest, resolve_sampling
from ninfer.frontends._tools import Tool, ToolPlan, render_tool_turns
from protocols import ApiError, Dialect, loads

__all__ = [
    "CLAMPED_HEADER",
    "Answer",
    "Choice",
    "Count",
    "FailingAnswer",
    "Frontend",
    "FrontendContext",
    "FrontendRoute",
    "Generate",
    "Look",
    "Outcome",
    "PathArgs",
    "Prepared",
    "Routed",
    "clamp_headers",
]

# Set when a clamping route cut the output budget a request asked for down to what the
# context and the KV pool leave: the budget the request got.
CLAMPED_HEADER = b"x-ninfer-max-tokens-clamped"


def clamp_headers(grant: Grant) -> tuple[tuple[bytes, bytes], ...]:
    if grant.clamped_from is None:
        return ()
    return ((CLAMPED_HEADER, str(grant.max_new_tokens).encode()),)


class Tokenize(Protocol):
    """A prompt's ids, off the event loop when it is long (`special`: a text's control
    tokens' texts read as those tokens)."""

    def __call__(self, prompt: str | ChatText, *, special: bool = True) -> Awaitable[list[int]]: ...


# Runs a function on a worker thread (bounded: the threads that tokenize long texts).
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]

T = TypeVar("T")

# A body larger than this is decoded and checked, and a conversation with more turns
# than this rendered, on a worker thread: 60,000 messages (3.7 MB) took seconds to
# decode, which on the event loop every other request and /health waited out.
INLINE_BODY_BYTES = 64 * 1024
# Prompts longer than this many characters are counted in pieces before they are
# encoded whole (`Tokenizer.exceeds`): one far over the context is refused within a
# context's worth of tokenizing. (Shorter ones cost little either way; counting a text
# that fits costs a second pass over it.)
LONG_PROMPT_CHARS = 32768
INLINE_TURNS = 64


# The error code of a chat request to a model whose file has no chat template (a base
# model such as Gemma 3 270M): `ninfer probe` reads it to skip what needs a chat.
NO_CHAT_TEMPLATE = "no_chat_template"
_ROLE_FOR_TEMPLATE = {"developer": "system"}  # ChatML templates know system, not developer


@attrs.frozen
class Choice:
    """One finished sequence of a request (OpenAI's choice)."""

    index: int
    token_ids: list[int]
    text: str
    finish: Finish
    logprobs: list[TokenLogprob]  # of its output tokens, when asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None  # when asked for


@attrs.frozen
class Outcome:
    """A finished generation, for building its answer: one choice per engine request."""

    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage  # the request's: each distinct prompt counted once
    timing: Mapping[str, float]

    # Frontends that ask for one sequence read it through these.
    @property
    def finish(self) -> Finish:
        return self.choices[0].finish

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids


class Answer(Protocol):
    """One request's answer in its protocol: the whole body, or the stream's frames."""

    def head(self) -> list[bytes]:
        """Frames right after the stream's headers."""
        ...

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        """Frames for new tokens of the choice at `index`."""
        ...

    def tail(self, outcome: Outcome) -> list[bytes]: ...

    def body(self, outcome: Outcome) -> bytes: ...


@runtime_checkable
class FailingAnswer(Protocol):
    """An answer whose protocol ends a failed stream with frames of its own making (a
    Response's `response.failed`, numbered in its sequence); others end it with their
    dialect's error frames."""

    def failed(self, err: ApiError) -> list[bytes]: ...


@runtime_checkable
class ProgressAnswer(Protocol):
    """An answer that streams its prompt's progress (llama-server's `prompt_progress`,
    for requests that ask with `return_progress`)."""

    def progress(self, index: int, progress: PromptProgress) -> list[bytes]: ...


@attrs.frozen(kw_only=True)
class Prepared:
    """What a frontend's preparation produces: the engine requests (one per choice,
    decoded together) and the answer."""

    requests: tuple[GenerationRequest, ...]
    stream: bool
    answer: Answer
    log_fields: Mapping[str, Any]  # request_start fields beyond the engine request's
    # The prompt each request continues (requests of one prompt share its KV pages and
    # count its tokens once in the usage); default: each its own.
    prompt_of: tuple[int, ...] = ()
    headers: tuple[tuple[bytes, bytes], ...] = ()  # added to the response's
    # An embedding request's: its inputs (one engine request each) go to the engine at
    # most this many at a time, under one running slot (0: every request at once, a
    # slot each: the sequences of a generation, decoded together).
    wave: int = 0

    @property
    def request(self) -> GenerationRequest:
        """The first request: what every choice shares (budget, sampling, stops)."""
        return self.requests[0]

    def usage(self, finishes: list[Finish]) -> Usage:
        """The request's usage: output of every choice, each distinct prompt once."""
        groups = self.prompt_of or tuple(range(len(finishes)))
        seen: set[int] = set()
        prompt = cached = 0
        for group, f in zip(groups, finishes, strict=True):
            if group not in seen:
                seen.add(group)
                prompt += f.usage.prompt_tokens
                cached += f.usage.cached_tokens
        return Usage(prompt, sum(f.usage.completion_tokens for f in finishes), cached)


@attrs.frozen
class FrontendContext:
    """What frontends share, fixed once the model is loaded."""

    model: ServedModel
    config: ServerConfig
    public_id: str  # the name /v1/models and the logs show: the first of `names`
    names: tuple[str, ...]  # every name a request may give as its `model`
    tokenize: Tokenize  # off the event loop for long texts
    created: int  # unix seconds, for OpenAI's `created`
    grammars: GrammarCompiler  # schemas and tools to grammars, on worker threads
    offload: Offload  # large bodies' decoding and large conversations' rendering

    @property
    def names_text(self) -> str:
        """The served names for a message: 'a' or 'a', 'b'."""
        return ", ".join(repr(n) for n in self.names)

    def check_model(self, name: str | None) -> str:
        """The one rule of every protocol: `model` is one of the served names (404
        model_not_found naming them, never echoing the request's); where a protocol
        lets it be left out (None), the served model (`public_id`)."""
        if name is None:
            return self.public_id
        if name not in self.names:
            raise ApiError(
                "model_not_found",
                f"the model named in the request is not served here; this server serves "
                f"{self.names_text} (see GET /v1/models; --served-model-name adds aliases)",
                param="model",
                code="model_not_found",
            )
        return name


@attrs.frozen
class PathArgs:
    """What a `Look` route reads of its request: the path's parameters, by the names
    its template gives them, and the query string."""

    params: Mapping[str, str]
    query: bytes


@attrs.frozen
class Generate:
    """A route served by the request flow: the frontend `prepare`s the JSON body, the
    scheduler admits it, the engine decodes it, the answer is written."""


@attrs.frozen
class Count:
    """A route answered from its JSON body without the engine (a token count): no place
    in the scheduler, a limit of its own. `answer` is the frontend's method."""

    answer: Callable[[Any, bytes], Awaitable[bytes]]


@attrs.frozen
class Look:
    """A route answered from what the frontend holds, by the path's parameters and the
    query (no body is read). `answer` is the frontend's method."""

    answer: Callable[[Any, PathArgs], bytes]


Action = Generate | Count | Look


@attrs.frozen
class FrontendRoute:
    """One path a frontend serves: its template (`{name}` stands for one segment, read
    into `PathArgs.params`) and what each method does there."""

    path: str
    methods: Mapping[str, Action]
    # The template's last parameter takes the rest of the path, slashes and all (a
    # model's name may hold one: `org/model`).
    rest: bool = False


class Routed(abc.ABC):
    """A protocol's routes: declared by the class (`routes()`, `dialect`), so that the
    route table exists before the model loads; served by the instance the lifespan
    builds from the `FrontendContext` once it has, which decodes bodies and tokenizes
    prompts for them (`decode`, `tokens`)."""

    dialect: ClassVar[Dialect]  # the protocol's refusals, on each of its routes
    # Its /v1 routes are served without `/v1` as well (clients given a base URL without
    # it post to `/chat/completions`): the OpenAI and Anthropic protocols.
    unversioned: ClassVar[bool] = False

    def __init__(self, ctx: FrontendContext) -> None:
        self.ctx = ctx

    @classmethod
    @abc.abstractmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        """The paths this frontend serves and what each method does there."""

    def id_prompt(self, ids: Sequence[int], param: str) -> str:
        """A prompt given as token ids: checked against the vocabulary (400 naming
        `param`), and its text (a byte-level token's part of a character: U+FFFD)."""
        vocab = self.ctx.model.identity.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(
                "invalid_request",
                f"{param} holds a token id outside the vocabulary (0 to {vocab - 1})",
                param=param,
                code="invalid_value",
            )
        tok = self.ctx.model.tokenizer
        return b"".join(map(tok.token_bytes, ids)).decode("utf-8", "replace")

    async def tokens(
        self, prompt: str | ChatText, *, prompt_param: str, special: bool = True
    ) -> list[int]:
        """The prompt's tokens (a rendered chat's client text never spells a control
        token; `special`: as Tokenize's), or a refusal of a text that cannot fit the
        context without tokenizing all of it: more bytes than the context's tokens could
        cover (at the most bytes one token spells) is refused before tokenizing; a long
        text is counted in pieces first, and refused as soon as the count passes the
        context (never a text that fits: the same count as its ids)."""
        model = self.ctx.model
        text = prompt.text if isinstance(prompt, ChatText) else prompt
        limit = model.max_context * model.tokenizer.max_token_bytes
        # A character is at most 4 UTF-8 bytes: only a text near the bound is measured.
        over = len(text) * 4 > limit and (
            len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit
        )
        if not over and len(text) > LONG_PROMPT_CHARS:
            over = await self.ctx.offload(
                lambda: model.tokenizer.exceeds(prompt, model.max_context, special=special)
            )
        if over:
            raise ApiError(
                "context_length_exceeded",
                f"the prompt is longer than a context of {model.max_context} tokens can "
                "hold (counted before tokenizing it whole)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return await self.ctx.tokenize(prompt, special=special)

    async def decode(self, body: bytes, parse: Callable[[Any], T]) -> T:
        """The body as JSON, checked by the codec's `parse`: on a worker thread when it
        is large (the codecs count messages, items and tools before reading them)."""
        if len(body) <= INLINE_BODY_BYTES:
            return parse(loads(body))
        result: T = await self.ctx.offload(lambda: parse(loads(body)))
        return result


class Frontend(Routed):
    """One protocol's generation route (its `endpoint`, served by the request flow),
    and any routes of its own beside it (`routes()`)."""

    endpoint: ClassVar[str]  # the generation route, as the request log and metrics name it
    protocol: ClassVar[str]  # request_start's `protocol`

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self.budget = Budget(ctx.model, ctx.config.default_max_tokens)

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        return (FrontendRoute(cls.endpoint, {"POST": Generate()}),)

    async def render_chat(
        self,
        conversation: list[dict[str, Any]],
        *,
        param: str,
        tools: Sequence[Tool] = (),
        thinking: ThinkingMode | None = None,
    ) -> ChatText:
        """`render_template` (below), on a worker thread for a long conversation."""
        if len(conversation) + len(tools) <= INLINE_TURNS:
            return self.render_template(conversation, param=param, tools=tools, thinking=thinking)
        result: ChatText = await self.ctx.offload(
            lambda: self.render_template(conversation, param=param, tools=tools, thinking=thinking)
        )
        return result

    def thinking(self, ask: ThinkingAsk) -> ThinkingMode | None:
        """How this request thinks (None: the model's template cannot), or a refusal of
        what it asked that the template cannot do."""
        template = self.ctx.model.tokenizer.chat_template
        support = template.thinking if template is not None else None
        return resolve_thinking(ask, support, self.ctx.config)

    def render_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        param: str,
        tools: Sequence[Tool] = (),
        thinking: ThinkingMode | None = None,
    ) -> ChatText:
        """The model's chat template over a conversation of {role, content} turns (and
        tool calls and results: `ninfer.frontends._tools`; `reasoning_content` of an
        assistant turn), ready for the assistant's reply, with `tools` offered
        (`developer` rendered as `system`: ChatML templates know no other) and
        `thinking`'s switches; a refusal naming `param` when there is no template or it
        refuses. With thinking off, a reasoning block the prompt still opens is closed."""
        template = self.ctx.model.tokenizer.chat_template
        if template is None:
            raise ApiError(
                "invalid_request",
                "this model has no chat template (its GGUF file carries none): send a plain "
                "prompt to /v1/completions or /v1/generate",
                param=param,
                code=NO_CHAT_TEMPLATE,
            )
        turns = [{**t, "role": _ROLE_FOR_TEMPLATE.get(str(t["role"]), t["role"])}
                 for t in conversation]  # fmt: skip
        offered = None
        if tools or any(t["role"] == "tool" or t.get("tool_calls") for t in turns):
            turns, offered = render_tool_turns(turns, tools, native=template.writes_tool_calls)
        variables = thinking.variables() if thinking is not None else None
        try:
            prompt = template.render_chat(
                turns, add_generation_prompt=True, tools=offered, variables=variables
            )
            return close_unwanted_thinking(prompt, thinking)
        except ValueError:
            raise ApiError(
                "invalid_request",
                "the chat template refused this conversation (check the order of roles)",
                param=param,
            ) from None

    def check_fits(self, requests: Sequence[GenerationRequest], *, param: str) -> None:
        """Refuse requests decoded together whose reserved pages the pool cannot hold at
        once (each alone passed the budget check)."""
        model = self.ctx.model
        pages = sum(model.pages_needed(len(r.prompt_ids), r.reserved_tokens) for r in requests)
        if pages > model.kv_pages:
            raise ApiError(
                "context_length_exceeded",
                f"the {len(requests)} sequences asked for need {pages} KV pages together; "
                f"the server's KV pool holds {model.kv_pages}",
                param=param,
                code="context_length_exceeded",
            )

    async def output_grammar(
        self,
        plan: ToolPlan | None,
        schema: dict[str, Any] | None,
        param: str,
        thinking: ThinkingMode | None = None,
    ) -> str | CompiledGrammar | None:
        """The grammar an answer is decoded under: the tools' (with the response
        format's `schema`, found at `param`, as its text), the format's alone, or none;
        after a free reasoning block when the request thinks."""
        think = thinking is not None and thinking.enabled
        if plan is not None:
            return await self.ctx.grammars.tools(plan, schema, param, think)
        if schema is not None:
            return await self.ctx.grammars.schema(schema, param, think)
        return None

    def log_fields(
        self, plan: ToolPlan | None = None, thinking: ThinkingMode | None = None, **more: Any
    ) -> dict[str, Any]:
        """request_start's fields beyond the engine request's: the protocol, the tools
        offered and the choice, the thinking mode, and the route's own (`more`)."""
        fields: dict[str, Any] = {"protocol": self.protocol, **more}
        if plan is not None:
            fields.update(plan.log_fields())
        if thinking is not None:
            fields.update(thinking.log_fields())
        return fields

    def reading(self, prompt: ChatText, thinking: ThinkingMode | None, *, tools: bool) -> Reading:
        """How the answer to `prompt` is read: apart from its reasoning when it thinks
        (from the start, when the prompt opened the block), and for calls."""
        think = thinking is not None and thinking.enabled
        return Reading(
            thinking=think,
            opens=think and opens_thinking(prompt.text),
            tools=tools,
            spell=self.ctx.model.tokenizer.token_bytes,
        )

    def prepared(
        self,
        gen: GenerationRequest,
        grant: Grant,
        *,
        stream: bool,
        answer: Answer,
        log_fields: Mapping[str, Any],
    ) -> Prepared:
        """A request of one sequence, ready for the flow: its budget in a header when a
        clamping route cut what it asked for."""
        return Prepared(
            requests=(gen,),
            stream=stream,
            answer=answer,
            log_fields=log_fields,
            headers=clamp_headers(grant),
        )

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
        clamp: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> tuple[GenerationRequest, Grant, tuple[str, ...]]:
        """The engine request every frontend ends with (after the one budget check), its
        budget, and the warnings about fields that had no effect."""
        grant = self.budget.grant(
            len(prompt_ids), requested, param=param, prompt_param=prompt_param, clamp=clamp
        )
        gen, warnings = self.generation(
            request_id, prompt_ids, grant, sampling=sampling, stop=stop, ignore_eos=ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
        return gen, grant, warnings

    def generation(
        self,
        request_id: str,
        prompt_ids: list[int],
        grant: Grant,
        *,
        sampling: SamplingRequest,
        stop: tuple[str, ...],
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> tuple[GenerationRequest, tuple[str, ...]]:
        """The engine request of a prompt whose budget was checked (`grant`), with its
        sampling resolved, and the warnings about fields that had no effect."""
        params, warnings = resolve_sampling(
            sampling, self.ctx.config, self.ctx.model.sampling_preset
        )
        gen = GenerationRequest(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=grant.max_new_tokens,
            sampling=params,
            stop=stop,
            ignore_eos=ignore_eos,
            reserve_tokens=grant.reserve_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        return gen, tuple(warnings)
