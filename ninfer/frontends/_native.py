"""POST /v1/generate: the native contract (protocols._native), as a frontend."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.engine import TokenDelta
from ninfer.frontends._base import Frontend, FrontendContext, Outcome, Prepared
from ninfer.frontends._budget import SamplingRequest
from protocols import (
    Encoder,
    GenerateResponse,
    NativeCodec,
    NativeDialect,
    NativeDoneEvent,
    NativeModel,
    NativeTokenEvent,
    Timing,
    Usage,
)

__all__ = ["NativeFrontend"]

NativeFinish = Literal["eos", "stop", "length", "context"]
FINISH_REASONS: dict[str, NativeFinish] = {
    "eos": "eos",
    "stop": "stop",
    "length": "length",
    "context": "length",
    "capacity": "length",  # never here: the native budget is reserved whole
}


@attrs.frozen
class NativeAnswer:
    encoder: Encoder
    model: NativeModel
    request_id: str
    warnings: tuple[str, ...]

    def head(self) -> list[bytes]:
        return []

    def delta(self, index: int, delta: TokenDelta) -> list[bytes]:
        event = NativeTokenEvent(list(delta.token_ids), delta.text)
        return [self.encoder.sse(event, "token")]

    def _summary(self, outcome: Outcome) -> dict[str, Any]:
        """The fields the whole answer and the stream's `done` event share."""
        f, u = outcome.finish, outcome.finish.usage
        return {
            "id": outcome.request_id,
            "model": self.model,
            "finish_reason": FINISH_REASONS[f.reason],
            "stop_sequence": f.stop_string,
            "seed": f.seed,
            "usage": Usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
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

    def __init__(self, ctx: FrontendContext) -> None:
        super().__init__(ctx, NativeDialect())
        self._codec = NativeCodec()
        ident = ctx.model.identity
        self.model = NativeModel(ctx.public_id, ident.architecture, ident.sha256)

    async def prepare(self, body: bytes, request_id: str) -> Prepared:
        req = await self.decode(body, self._codec.parse_generate)
        ids = await self.tokens(req.prompt, prompt_param="prompt")
        gen, _grant, warnings = self.request(
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
                else await self.ctx.compile_schema(req.json_schema, "json_schema"),
            ),
            stop=tuple(req.stop or ()),
            ignore_eos=req.ignore_eos,
        )
        answer = NativeAnswer(self.dialect.encoder, self.model, request_id, warnings)
        return Prepared((gen,), req.stream, answer, {"protocol": self.protocol})
