"""POST /v1/generate: the native contract (protocols._native), as a frontend."""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.engine import TokenDelta
from ninfer.frontends._base import (
    Count,
    Frontend,
    FrontendContext,
    FrontendRoute,
    Outcome,
    Prepared,
    Routed,
)
from ninfer.frontends._finish import FINISH
from ninfer.frontends._sampling import SamplingRequest, sampling_defaults
from protocols import (
    ApiError,
    DetokenizeResponse,
    Encoder,
    GenerateResponse,
    NativeCodec,
    NativeDialect,
    NativeDoneEvent,
    NativeModel,
    NativeTokenEvent,
    Timing,
    TokenizeResponse,
    TokenPiece,
    Usage,
)

__all__ = ["NativeFrontend", "TokenizeFrontend", "server_props"]


@attrs.frozen(kw_only=True)
class NativeAnswer:
    encoder: Encoder
    model: NativeModel
    request_id: str
    warnings: tuple[str, ...]

    def head(self) -> list[bytes]:
        return []

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        event = NativeTokenEvent(token_ids=list(delta.token_ids), text=delta.text)
        return [self.encoder.sse(event, "token")]

    def _summary(self, outcome: Outcome) -> dict[str, Any]:
        """The fields the whole answer and the stream's `done` event share."""
        f, u = outcome.finish, outcome.finish.usage
        return {
            "id": outcome.request_id,
            "model": self.model,
            "finish_reason": FINISH[f.reason].native,
            "stop_sequence": f.stop_string,
            "seed": f.seed,
            "usage": Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
            ),
            "warnings": list(self.warnings),
            "timing": Timing(**outcome.timing),
        }

    def tail(self, outcome: Outcome) -> list[bytes]:
        return [self.encoder.sse(NativeDoneEvent(**self._summary(outcome)), "done")]

    def body(self, outcome: Outcome) -> bytes:
        whole = GenerateResponse(
            text=outcome.text, token_ids=outcome.token_ids, **self._summary(outcome)
        )
        return self.encoder.json(whole)


class NativeFrontend(Frontend):
    endpoint = "/v1/generate"
    protocol = "native"
    dialect = NativeDialect()

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = NativeCodec()
        ident = ctx.model.identity
        self.model = NativeModel(
            id=ctx.public_id, architecture=ident.architecture, sha256=ident.sha256
        )

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_generate)
        ids = await self.tokens(req.prompt, prompt_param="prompt")
        gen, grant, warnings = self.request(
            request_id,
            ids,
            requested=req.max_new_tokens,
            param="max_new_tokens",
            prompt_param="prompt",
            sampling=SamplingRequest(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                grammar=None
                if req.json_schema is None
                else await self.ctx.grammars.schema(req.json_schema, "json_schema"),
            ),
            stop=tuple(req.stop or ()),
            ignore_eos=req.ignore_eos,
        )
        answer = NativeAnswer(
            encoder=self.dialect.encoder, model=self.model, request_id=request_id, warnings=warnings
        )
        return self.prepared(
            gen, grant, stream=req.stream, answer=answer, log_fields=self.log_fields()
        )


class TokenizeFrontend(Routed):
    """POST /tokenize and /detokenize, in the shapes llama.cpp's server and vLLM answer
    (docs/api.md): the served model's tokenizer, no place in the scheduler."""

    dialect = NativeDialect()

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = NativeCodec()

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        return (
            FrontendRoute("/tokenize", {"POST": Count(cls.tokenize)}),
            FrontendRoute("/detokenize", {"POST": Count(cls.detokenize)}),
        )

    async def tokenize(self, body: bytes) -> bytes:
        req = await self.decode(body, self._codec.parse_tokenize)
        if req.model is not None:
            self.ctx.check_model(req.model)
        text, param = req.text()
        ids = await self.tokens(text, prompt_param=param, special=req.parse_special)
        context = self.ctx.model.max_context
        if len(ids) > context:  # docs/api.md: as a prompt of that length would be
            raise ApiError(
                "context_length_exceeded",
                f"the text is {len(ids)} tokens, more than the context of {context} holds",
                param=param,
                code="context_length_exceeded",
            )
        tok = self.ctx.model.tokenizer
        added = tok.encode("")  # what the model puts before every prompt (its BOS), if any
        if not req.bos() and added and ids[: len(added)] == added:
            ids = ids[len(added) :]
        tokens: list[int] | list[TokenPiece] = ids
        if req.with_pieces:
            tokens = [TokenPiece(i, _piece(tok.token_bytes(i))) for i in ids]
        answer = TokenizeResponse(tokens, len(ids), self.ctx.model.max_context)
        return self.dialect.encoder.json(answer)

    async def detokenize(self, body: bytes) -> bytes:
        req = await self.decode(body, self._codec.parse_detokenize)
        if req.model is not None:
            self.ctx.check_model(req.model)
        context = self.ctx.model.max_context
        if len(req.tokens) > context:  # as /tokenize's texts: no more than a context
            raise ApiError(
                "invalid_request",
                f"tokens has {len(req.tokens)} ids; at most {context} (the context) are taken",
                param="tokens",
                code="invalid_value",
            )
        vocab = self.ctx.model.identity.vocab_size
        for i, token in enumerate(req.tokens):
            if not 0 <= token < vocab:
                raise ApiError(
                    "invalid_request",
                    f"tokens[{i}] is not in the vocabulary (0 to {vocab - 1})",
                    param=f"tokens[{i}]",
                )
        tok = self.ctx.model.tokenizer

        def text_of() -> str:
            raw = b"".join(tok.token_bytes(t) for t in req.tokens)
            return raw.decode("utf-8", errors="replace")

        if len(req.tokens) <= _INLINE_TOKENS:
            text = text_of()
        else:
            text = await self.ctx.offload(text_of)  # (a context's worth: milliseconds)
        return self.dialect.encoder.json(DetokenizeResponse(text, text))


# Up to this many ids are turned into text on the event loop; more, on a worker thread.
_INLINE_TOKENS = 1024


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (llama.cpp's
    server answers the same)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def server_props(ctx: FrontendContext) -> dict[str, Any]:
    """GET /props, in the shape of llama.cpp's server where it has one (n_ctx,
    total_slots, chat_template, default_generation_settings, modalities, build_info),
    with ninfer's own: the served names and what the model can do here."""
    from ninfer import __version__

    defaults = sampling_defaults(ctx.config, ctx.model.sampling_preset)
    template = ctx.model.tokenizer.chat_template
    ident = ctx.model.identity
    return {
        "model": ctx.public_id,
        "served_names": list(ctx.names),
        "architecture": ident.architecture,
        "n_ctx": ctx.model.max_context,
        "total_slots": ctx.config.max_concurrency,
        # llama-server's: the file served, the name it answers to, its special tokens
        "model_path": ident.path,
        "model_alias": ctx.public_id,
        "bos_token": template.bos_token if template is not None else "",
        "eos_token": template.eos_token if template is not None else "",
        "chat_template": template.source if template is not None else None,
        "chat_template_caps": _template_caps(ctx),
        "capabilities": {
            "chat": template is not None,
            "tools": template is not None,
            "structured_outputs": True,
            "thinking": template is not None and template.thinking is not None,
            "vision": False,
            "audio": False,
        },
        "modalities": {"vision": False, "audio": False},
        # What the chat template does with reasoning, and the server's defaults for it.
        "thinking": _thinking_props(ctx),
        # --spec as it runs ("none" where the start-up checks refused it)
        "speculative": ctx.model.speculative,
        "default_generation_settings": {
            "n_ctx": ctx.model.max_context,
            "params": {
                **defaults,
                "seed": ctx.config.seed,
                # What a chat, Responses or /completion request naming no budget gets: up
                # to the room the context and the pool leave (llama-server's -1, which its
                # web UI shows as no limit)
                "max_tokens": -1,
                "n_predict": -1,
                # ninfer's own: the native route's (/v1/generate) default, strict
                "max_new_tokens": ctx.config.default_max_tokens,
            },
        },
        "build_info": f"ninfer {__version__}",
        # llama-server's sleeping on idle (its --sleep-idle-seconds): ninfer never unloads
        "is_sleeping": False,
    }


def _template_caps(ctx: FrontendContext) -> dict[str, bool]:
    """llama-server's `chat_template_caps`, as ninfer's chat pipeline serves the model:
    string content (a message's text parts are joined before rendering), tools and
    their calls on every template (a template without them gets ninfer's tool section),
    parallel calls, a system role, a call's arguments given to the template as an
    object, preserved reasoning where the template takes it; no effort levels."""
    template = ctx.model.tokenizer.chat_template
    if template is None:
        return {}
    thinking = template.thinking
    return {
        "supports_string_content": True,
        "supports_typed_content": False,
        "supports_tools": True,
        "supports_tool_calls": True,
        "supports_parallel_tool_calls": True,
        "supports_system_role": True,
        "supports_preserve_reasoning": thinking is not None and thinking.preserve,
        "supports_reasoning_effort": False,
        "supports_object_arguments": True,
    }


def _thinking_props(ctx: FrontendContext) -> dict[str, Any]:
    template = ctx.model.tokenizer.chat_template
    support = template.thinking if template is not None else None
    if support is None:
        return {"supported": False}
    return {
        "supported": True,
        "default": not ctx.config.no_thinking,  # --no-thinking
        "preserve": ctx.config.preserve_thinking and support.preserve,
        "preserve_supported": support.preserve,  # the template takes preserve_thinking
        "opens_block": support.opens,  # the prompt opens <think> itself
    }
