"""llama.cpp's server's own generation route, POST /completion, in its shapes
(protocols._llama): a raw prompt (text or token ids), `n_predict`, its answer's
`content`, `stop`, `stop_type`, `tokens_*` and `timings`, streamed as `data:` events
with no `[DONE]`."""

from __future__ import annotations

import attrs

from ninfer.engine import PromptProgress, TokenDelta
from ninfer.frontends._base import Frontend, FrontendContext, Outcome, Prepared
from ninfer.frontends._sampling import SamplingRequest
from ninfer.frontends._timings import Clock, final_timings, progress_body
from protocols import (
    ApiError,
    Encoder,
    LlamaCodec,
    LlamaCompletion,
    LlamaCompletionRequest,
    NativeDialect,
    llama_bias,
)

__all__ = ["LlamaCompletionFrontend"]

# How an engine request ended, in llama-server's `stop_type`.
_STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit",
               "capacity": "limit"}  # fmt: skip


@attrs.frozen(kw_only=True)
class LlamaAnswer:
    encoder: Encoder
    model: str
    prompt: str
    return_tokens: bool
    clock: Clock  # llama-server's timings, with every token on `timings_per_token`

    def head(self) -> list[bytes]:
        return []

    def progress(self, index: int, progress: PromptProgress) -> list[bytes]:
        event = LlamaCompletion(
            content="",
            tokens=[],
            stop=False,
            model=self.model,
            prompt_progress=progress_body(progress),
        )
        return [self.encoder.sse(event)]

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        event = LlamaCompletion(
            content=delta.text,
            tokens=list(delta.token_ids) if self.return_tokens else [],
            stop=False,
            model=self.model,
            timings=self.clock.step(index, delta),
        )
        return [self.encoder.sse(event)]

    def _last(self, outcome: Outcome, content: str) -> LlamaCompletion:
        f, u = outcome.finish, outcome.finish.usage
        return LlamaCompletion(
            content=content,
            tokens=list(outcome.token_ids) if self.return_tokens and content else [],
            stop=True,
            model=self.model,
            tokens_predicted=u.completion_tokens,
            tokens_evaluated=u.prompt_tokens,
            tokens_cached=u.cached_tokens,
            prompt=self.prompt,
            has_new_line="\n" in outcome.text,
            truncated=False,
            stop_type=_STOP_TYPES[f.reason],
            stopping_word=f.stop_string or "",
            timings=final_timings(outcome),
        )

    def tail(self, outcome: Outcome) -> list[bytes]:
        return [self.encoder.sse(self._last(outcome, ""))]

    def body(self, outcome: Outcome) -> bytes:
        return self.encoder.json(self._last(outcome, outcome.text))


class LlamaCompletionFrontend(Frontend):
    """POST /completion, as llama-server answers it (docs/api.md, "From llama-server")."""

    endpoint = "/completion"
    protocol = "native"  # ninfer's own family of routes (the request log's protocols)
    dialect = NativeDialect()

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx)
        self._codec = LlamaCodec()

    def _bias(self, req: LlamaCompletionRequest) -> tuple[tuple[int, float], ...]:
        """llama-server's logit_bias as (token id, bias) pairs: a text's tokens (read as
        plain text, without the BOS token) each get its bias; the last bias of an id
        counts."""
        tok = self.ctx.model.tokenizer
        vocab = self.ctx.model.identity.vocab_size
        bos = tok.encode_plain("")
        out: dict[int, float] = {}
        for i, (key, value) in enumerate(llama_bias(req.logit_bias)):
            if isinstance(key, int):
                if not 0 <= key < vocab:
                    raise ApiError(
                        "invalid_request",
                        f"logit_bias names a token id outside the vocabulary (0 to {vocab - 1})",
                        param="logit_bias" if isinstance(req.logit_bias, dict)
                        else f"logit_bias[{i}]",
                        code="invalid_value",
                    )  # fmt: skip
                ids = [key]
            else:
                ids = tok.encode_plain(key)[len(bos) :]
            for token in ids:
                out[token] = value
        return tuple(sorted(out.items()))

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_completion)
        model = self.ctx.check_model(req.model)
        if isinstance(req.prompt, str):
            ids = await self.tokens(req.prompt, prompt_param="prompt")
            prompt = req.prompt
        else:
            ids = list(req.prompt)
            prompt = self.id_prompt(ids, "prompt")
        grammar = None
        if req.json_schema is not None:
            grammar = await self.ctx.grammars.schema(req.json_schema, "json_schema")
        bias = self._bias(req)
        sampling = SamplingRequest(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=None if req.seed in (None, -1) else req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            grammar=grammar,
            logit_bias=bias,
            repeat_penalty=req.repeat_penalty,
            repeat_last_n=req.repeat_last_n,
            samplers=tuple(req.samplers) if req.samplers is not None else None,
        )
        # -1, or none (llama-server's default -n): up to the room left, as /props says
        requested = None if req.n_predict in (None, -1) else req.n_predict
        gen, grant, _warnings = self.request(
            request_id,
            ids,
            requested=requested,
            param="n_predict",
            prompt_param="prompt",
            sampling=sampling,
            stop=tuple(req.stop or ()),
            ignore_eos=bool(req.ignore_eos),
            clamp=True,
        )
        answer = LlamaAnswer(
            encoder=self.dialect.encoder,
            model=model,
            prompt=prompt,
            return_tokens=bool(req.return_tokens),
            clock=Clock((len(ids),), bool(req.timings_per_token)),
        )
        if req.stream and req.return_progress:
            gen = attrs.evolve(gen, progress=True)
        return self.prepared(
            gen, grant, stream=bool(req.stream), answer=answer, log_fields=self.log_fields()
        )
