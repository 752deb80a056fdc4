"""POST /v1/generate: the native contract, wired to the generation flow."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ninfer._budget import Limits, SamplingRequest, resolve_budget, resolve_sampling
from ninfer._config import ServerConfig
from ninfer._generation import Outcome, Prepared
from ninfer._messages import GenerationRequest, TokenDelta
from protocols import ApiError, NativeCodec, error_body, loads, response_body, sse_event

__all__ = ["NativeResponder", "native_preparer"]

FINISH_REASONS = {"eos": "eos", "stop": "stop", "length": "length", "context": "length"}


class NativeResponder:
    content_type_stream = b"text/event-stream"

    def __init__(self, model: Mapping[str, Any]) -> None:
        self._model = dict(model)

    def error_status(self, err: ApiError) -> int:
        return err.status

    def error(self, err: ApiError, request_id: str) -> bytes:
        return error_body(err, request_id)

    def stream_head(self, prepared: Prepared, request_id: str) -> list[bytes]:
        return []

    def stream_delta(self, delta: TokenDelta, request_id: str) -> list[bytes]:
        return [sse_event("token", {"token_ids": list(delta.token_ids), "text": delta.text})]

    def stream_tail(self, outcome: Outcome, prepared: Prepared) -> list[bytes]:
        f = outcome.finish
        return [
            sse_event(
                "done",
                {
                    "id": outcome.request_id,
                    "model": self._model,
                    "finish_reason": FINISH_REASONS[f.reason],
                    "stop_sequence": f.stop_string,
                    "seed": f.seed,
                    "usage": {
                        "prompt_tokens": f.usage.prompt_tokens,
                        "completion_tokens": f.usage.completion_tokens,
                        "total_tokens": f.usage.total_tokens,
                    },
                    "warnings": list(prepared.warnings),
                    "timing": outcome.timing,
                },
            )
        ]

    def stream_error(self, err: ApiError, request_id: str) -> list[bytes]:
        return [b"event: error\ndata: " + error_body(err, request_id) + b"\n\n"]

    def body(self, outcome: Outcome, prepared: Prepared) -> bytes:
        f = outcome.finish
        return response_body(
            request_id=outcome.request_id,
            model=self._model,
            text=outcome.text,
            token_ids=outcome.token_ids,
            finish_reason=FINISH_REASONS[f.reason],
            stop_sequence=f.stop_string,
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            warnings=prepared.warnings,
            timing=outcome.timing,
            seed=f.seed,
        )


def native_preparer(
    *,
    codec: NativeCodec,
    config: ServerConfig,
    limits: Limits,
    tokenize: Callable[[str], Awaitable[list[int]]],
    request_id: str,
    check: Callable[[GenerationRequest], None],
) -> Callable[[bytes], Awaitable[Prepared]]:
    async def prepare(body: bytes) -> Prepared:
        req = codec.parse_generate(loads(body))
        ids = await tokenize(req.prompt)
        if not ids:
            raise ApiError("invalid_request", "prompt produces no tokens", param="prompt")
        budget = resolve_budget(
            len(ids), req.max_new_tokens, limits, param="max_new_tokens", prompt_param="prompt"
        )
        sampling, warnings = resolve_sampling(
            SamplingRequest(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
            ),
            config,
        )
        gen = GenerationRequest(
            request_id=request_id,
            prompt_ids=tuple(ids),
            max_new_tokens=budget,
            sampling=sampling,
            stop=tuple(req.stop or ()),
            ignore_eos=req.ignore_eos,
        )
        check(gen)
        return Prepared(
            request=gen,
            stream=req.stream,
            warnings=tuple(warnings),
            log_fields={"protocol": "native"},
        )

    return prepare
