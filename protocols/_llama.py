"""llama.cpp's server's own routes, for its clients: POST /completion (a raw prompt,
llama-server's request and answer shapes) and POST /apply-template (a chat rendered to
its prompt). Errors are the native shape (docs/api.md, "From llama-server")."""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._answers import LlamaTimings, PromptProgressBody
from protocols._native import MAX_STOP_CHARS, MAX_STOPS
from protocols._openai import LOGIT_BIAS_MAX, refuse_known
from protocols._schema import check_limits, schema
from protocols._strict import (
    InvalidType,
    invalid_value,
    make_converter,
    register_list,
    register_text_or_list,
    structure,
)

__all__ = [
    "AppliedTemplate",
    "LlamaCodec",
    "LlamaCompletion",
    "LlamaCompletionRequest",
    "llama_bias",
]

_REFUSED = schema(refused=True)


@attrs.frozen
class LlamaCompletionRequest:
    """POST /completion: llama-server's fields that ninfer honours, those it accepts
    without effect, and those it refuses by name."""

    prompt: str | list[int]
    # -1: as many tokens as the context and the KV pool leave room for; none: the
    # server's --default-max-tokens (llama-server's own default is its -n flag's)
    n_predict: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    stream: bool | None = None
    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=2))
    top_k: int | None = attrs.field(default=None, metadata=schema(minimum=0))
    top_p: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=1))
    min_p: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=1))
    presence_penalty: float | None = attrs.field(
        default=None, metadata=schema(minimum=-2, maximum=2)
    )
    frequency_penalty: float | None = attrs.field(
        default=None, metadata=schema(minimum=-2, maximum=2)
    )
    repeat_penalty: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0))
    repeat_last_n: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    samplers: list[str] | None = attrs.field(default=None, metadata=schema(maxItems=16))
    # -1 (its default): a random seed
    seed: int | None = attrs.field(default=None, metadata=schema(minimum=-1, maximum=2**32 - 1))
    stop: list[str] | None = attrs.field(
        default=None,
        metadata=schema(maxItems=MAX_STOPS, items={"minLength": 1, "maxLength": MAX_STOP_CHARS}),
    )
    ignore_eos: bool | None = None
    json_schema: dict[str, Any] | None = None  # enforced while decoding
    # [[token id or text, bias]], or {"token id or text": bias}; a text's tokens all get
    # the bias; false bans (-100); -100..100
    logit_bias: list[Any] | dict[str, Any] | None = None
    return_tokens: bool | None = None  # the tokens' ids in the answer
    model: str | None = None  # a served name (checked), or none: the served model
    # Accepted without effect: the prefix cache is always on; a slot is not chosen here;
    # no timings per token, progress or pings are streamed; sampling runs in the engine.
    cache_prompt: bool | None = None
    id_slot: int | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    backend_sampling: bool | None = None
    # Known, not supported here.
    grammar: Any = attrs.field(default=None, metadata=_REFUSED)
    n_probs: Any = attrs.field(default=None, metadata=_REFUSED)
    image_data: Any = attrs.field(default=None, metadata=_REFUSED)
    multimodal_data: Any = attrs.field(default=None, metadata=_REFUSED)
    lora: Any = attrs.field(default=None, metadata=_REFUSED)


@attrs.frozen(kw_only=True)
class LlamaCompletion:
    """/completion's answer, and each of its stream's `data:` events (`stop` false
    until the last, which carries the totals)."""

    index: int = 0
    content: str
    tokens: list[int]
    id_slot: int = -1
    stop: bool
    model: str
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    prompt: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: str | None = None  # none, eos, limit, word
    stopping_word: str | None = None
    timings: LlamaTimings | None = None
    prompt_progress: PromptProgressBody | None = None


@attrs.frozen(kw_only=True)
class AppliedTemplate:
    """POST /apply-template's answer: the chat's prompt as text."""

    prompt: str


def llama_bias(bias: list[Any] | dict[str, Any] | None) -> list[tuple[int | str, float]]:
    """llama-server's logit_bias as (token id or text, bias) pairs, checked: a pair of a
    token id (an integer, or digits in an object's key) or a text, and a number within
    -100..100 or false (a ban: -100)."""
    if bias is None:
        return []
    items = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(items) > LOGIT_BIAS_MAX:
        raise invalid_value("logit_bias", f"logit_bias takes at most {LOGIT_BIAS_MAX} entries")
    pairs: list[tuple[int | str, float]] = []
    for i, item in enumerate(items):
        where = "logit_bias" if isinstance(bias, dict) else f"logit_bias[{i}]"
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise invalid_value(where, "a logit_bias entry is [token id or text, bias]")
        key, value = item
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int | str) or key == "":
            raise invalid_value(where, "a logit_bias entry names a token id or a text")
        if value is False:
            value = -100.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid_value(where, "a logit_bias value is a number or false")
        if not -100 <= value <= 100:
            raise invalid_value(where, "logit_bias values must be between -100 and 100")
        pairs.append((key, float(value)))
    return pairs


class LlamaCodec:
    def __init__(self) -> None:
        conv = make_converter()
        register_list(conv, str)
        register_text_or_list(conv, int, "token ids")
        conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)

        def bias_hook(value: Any, _: type) -> Any:
            if value is None or isinstance(value, list | dict):
                return value
            raise InvalidType("array of [token, bias] pairs or object")

        conv.register_structure_hook_func(
            lambda t: t == (list[Any] | dict[str, Any] | None), bias_hook
        )
        self._conv: cattrs.Converter = conv

    def parse_completion(self, body: Any) -> LlamaCompletionRequest:
        req = structure(self._conv, body, LlamaCompletionRequest)
        if req.n_probs == 0:  # llama-server's default: none
            req = attrs.evolve(req, n_probs=None)
        refuse_known(req)
        if req.n_predict == 0:
            raise invalid_value(
                "n_predict",
                "n_predict must be at least 1, or -1 (as many tokens as the context and the "
                "KV pool leave room for)",
            )
        if not req.prompt:
            raise invalid_value("prompt", "prompt must not be empty")
        llama_bias(req.logit_bias)
        check_limits(req)
        return req
