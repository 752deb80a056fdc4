"""Embeddings: OpenAI's POST /v1/embeddings and llama-server's POST /embedding and
/embeddings (protocols._embeddings), served by the request flow as generation is: a
place in the scheduler, admission under the pending deadline, cancellation when the
client goes away, one request_start and one request_done (`kind: embedding`).

Each input is one engine request that computes its prompt and samples nothing
(`GenerationRequest.embed`); the engine pools the final-norm states of the whole
prompt (never served from the prefix cache) and normalizes them as llama-server does.
An input's vector is the same alone or in any batch. A request's inputs go to the
engine at most EMBED_WAVE at a time, under one running slot (docs/api.md, "Embeddings").
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar

import attrs

from ninfer.engine import Embedding, EmbedSpec, GenerationRequest, Pooling, TokenDelta
from ninfer.frontends._base import (
    Frontend,
    FrontendContext,
    FrontendRoute,
    Generate,
    Outcome,
    Prepared,
)
from protocols import (
    ApiError,
    EmbeddingCodec,
    EmbeddingData,
    EmbeddingInput,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    Encoder,
    LlamaEmbedding,
    LlamaEmbeddingRequest,
    NativeDialect,
    OpenAIDialect,
)

__all__ = ["EMBED_MAX_TOTAL_TOKENS", "EMBED_WAVE", "EmbeddingsFrontend", "LlamaEmbeddingFrontend"]

# The most tokens one request's inputs may hold together (OpenAI's bound for its own
# embedding models): past it, 400 naming the input field.
EMBED_MAX_TOTAL_TOKENS = 300_000
# The most inputs of one request in the engine at once: enough that a prefill pass takes
# several short inputs together (an input's vector does not depend on it). The request
# is admitted with the KV pages of its EMBED_WAVE longest inputs.
EMBED_WAVE = 16


@attrs.frozen(kw_only=True)
class _Resolved:
    """A request's inputs as token ids, and how they are pooled."""

    ids: list[list[int]]
    pooling: Pooling
    normalize: int


class _Embeddings(Frontend):
    """What both embedding routes share: inputs to token ids under the limits, the
    pooling and normalization, the engine requests."""

    protocol: ClassVar[str]

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = EmbeddingCodec()
        configured = ctx.config.pooling
        # --pooling auto: the file's pooling_type (an embedding model's), else mean
        self.pooling: Pooling = (
            (ctx.model.identity.pooling or "mean") if configured == "auto" else configured  # type: ignore[assignment]
        )

    async def _input_ids(self, inp: EmbeddingInput, truncate: int | None) -> list[int]:
        """One input's token ids, as llama-server tokenizes a prompt: texts with their
        control tokens read as such, the BOS token (where the model wants one) before a
        first text only; token ids as the model's own. Longer than the context: refused
        naming the input, or cut to its last `truncate` tokens when asked."""
        model = self.ctx.model
        tok = model.tokenizer
        vocab = model.identity.vocab_size
        ids: list[int] = []
        bos = tok.encode("") if len(inp.pieces) > 1 else []
        for i, piece in enumerate(inp.pieces):
            if isinstance(piece, int):
                if not 0 <= piece < vocab:
                    raise ApiError(
                        "invalid_request",
                        f"{inp.param} holds a token id outside the vocabulary (0 to {vocab - 1})",
                        param=inp.param,
                        code="invalid_value",
                    )
                ids.append(piece)
                continue
            if truncate is None:
                got = await self.tokens(piece, prompt_param=inp.param)
            else:  # tokenized whole, then cut (the body's size bounds it)
                got = await self.ctx.tokenize(piece)
            if i > 0 and bos and got[: len(bos)] == bos:
                got = got[len(bos) :]
            ids.extend(got)
        if not ids:
            raise ApiError(
                "invalid_request",
                f"{inp.param} has no tokens (an empty text, for a model that adds no BOS)",
                param=inp.param,
                code="invalid_value",
            )
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        wrong = model.misfit(len(ids), 0)  # the engine's one rule of what fits
        if wrong is not None:
            raise ApiError(
                "context_length_exceeded",
                f"{inp.param} is {len(ids)} tokens, too large to process: the context holds "
                f"{model.max_context} (truncate_prompt_tokens cuts an input to its last tokens)"
                if wrong.limit == "context"
                else f"{inp.param} needs more KV pages than the server's pool holds",
                param=inp.param,
                code="context_length_exceeded",
            )
        return ids

    async def resolve(
        self, req: EmbeddingRequest | LlamaEmbeddingRequest, param: str, *, oai: bool
    ) -> _Resolved:
        model = self.ctx.model
        pooling: Pooling = req.pooling or self.pooling  # type: ignore[assignment]
        if oai and pooling == "none":
            raise ApiError(
                "invalid_request",
                "pooling 'none' (a vector per token) has no OpenAI shape: send pooling mean, "
                "last or cls, or use POST /embedding"
                + ("" if req.pooling else " (the server's --pooling is none)"),
                param="pooling",
                code="invalid_value",
            )
        truncate = req.truncate_prompt_tokens
        if truncate is not None:
            if truncate == -1:
                truncate = model.max_context
            elif truncate > model.max_context:
                raise ApiError(
                    "invalid_request",
                    f"truncate_prompt_tokens is at most the context's {model.max_context} "
                    "tokens (or -1)",
                    param="truncate_prompt_tokens",
                    code="invalid_value",
                )
        ids: list[list[int]] = []
        total = 0
        for inp in req.inputs():
            ids.append(await self._input_ids(inp, truncate))
            total += len(ids[-1])
            if total > EMBED_MAX_TOTAL_TOKENS:
                raise ApiError(
                    "invalid_request",
                    f"the inputs hold more than {EMBED_MAX_TOTAL_TOKENS} tokens together; "
                    "send them in several requests",
                    param=param,
                    code="invalid_value",
                )
        normalize = self.ctx.config.embd_normalize
        if req.embd_normalize is not None:
            normalize = req.embd_normalize
        return _Resolved(ids=ids, pooling=pooling, normalize=normalize)

    def prepared_embeddings(self, request_id: str, resolved: _Resolved, answer: Any) -> Prepared:
        spec = EmbedSpec(resolved.pooling, resolved.normalize)
        requests = tuple(
            GenerationRequest(request_id, tuple(ids), 0, embed=spec) for ids in resolved.ids
        )
        fields = self.log_fields(
            kind="embedding",
            inputs=len(requests),
            pooling=resolved.pooling,
            normalize=resolved.normalize,
        )
        return Prepared(
            requests=requests, stream=False, answer=answer, log_fields=fields, wave=EMBED_WAVE
        )


def _embeddings(outcome: Outcome) -> list[tuple[int, Embedding]]:
    """Each input's index and vector(s), in the inputs' order."""
    out = []
    for c in outcome.choices:
        assert c.finish.embedding is not None  # every input of a settled request has one
        out.append((c.index, c.finish.embedding))
    return out


class _NoStream:
    """An embedding answer is one JSON body: it has no stream frames."""

    def head(self) -> list[bytes]:
        return []

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        return []

    def tail(self, outcome: Outcome) -> list[bytes]:
        return []


@attrs.frozen(kw_only=True)
class EmbeddingAnswer(_NoStream):
    encoder: Encoder
    model: str
    base64: bool

    def body(self, outcome: Outcome) -> bytes:
        data = []
        for i, e in _embeddings(outcome):
            vector: list[float] | str = (
                base64.b64encode(e.row(0)).decode("ascii") if self.base64 else e.vectors()[0]
            )
            data.append(EmbeddingData(index=i, embedding=vector))
        tokens = outcome.usage.prompt_tokens
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return self.encoder.json(EmbeddingList(data=data, model=self.model, usage=usage))


@attrs.frozen(kw_only=True)
class LlamaEmbeddingAnswer(_NoStream):
    encoder: Encoder

    def body(self, outcome: Outcome) -> bytes:
        items = [
            self.encoder.json(LlamaEmbedding(index=i, embedding=e.vectors()))
            for i, e in _embeddings(outcome)
        ]
        return b"[" + b",".join(items) + b"]"


class EmbeddingsFrontend(_Embeddings):
    """POST /v1/embeddings, OpenAI's (docs/api.md, "Embeddings")."""

    endpoint = "/v1/embeddings"
    protocol = "openai"
    dialect = OpenAIDialect()

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse)
        model = self.ctx.check_model(req.model)
        width = self.ctx.model.embedding_length
        if req.dimensions is not None and req.dimensions != width:
            raise ApiError(
                "invalid_request",
                f"the served model's vectors have {width} values and cannot be shortened; "
                "leave dimensions out",
                param="dimensions",
                code="unsupported_parameter",
            )
        resolved = await self.resolve(req, "input", oai=True)
        answer = EmbeddingAnswer(
            encoder=self.dialect.encoder, model=model, base64=req.encoding_format == "base64"
        )
        return self.prepared_embeddings(request_id, resolved, answer)


class LlamaEmbeddingFrontend(_Embeddings):
    """POST /embedding and /embeddings, llama-server's: a JSON array of {index,
    embedding} with the vector as one row (pooling none: a row a token)."""

    endpoint = "/embeddings"
    protocol = "native"
    dialect = NativeDialect()

    @classmethod
    def routes(cls) -> tuple[FrontendRoute, ...]:
        return tuple(FrontendRoute(p, {"POST": Generate()}) for p in ("/embedding", "/embeddings"))

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_llama)
        self.ctx.check_model(req.model)
        param = "input" if req.input is not None else "content"
        resolved = await self.resolve(req, param, oai=False)
        return self.prepared_embeddings(
            request_id, resolved, LlamaEmbeddingAnswer(encoder=self.dialect.encoder)
        )
