"""Embeddings on the wire: OpenAI's POST /v1/embeddings and llama-server's POST
/embedding and /embeddings (its own answer shape, and `content` beside `input`).

An input is what llama-server's tokenizer takes (`tokenize_input_prompts`): a text,
an array of token ids, an array mixing texts and token ids (one prompt, its pieces in
order), or an object (`{"prompt_string": text}`, or `{"content": [text parts]}`, as
OpenAI's content parts); `input` is one of those or an array of them. Parsed here into
`EmbeddingInput`s, each refusal naming its place (`input[2]`, `input[1].content[0]`).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import cattrs

from protocols._answers import tag
from protocols._schema import check_limits, schema
from protocols._strict import (
    ARRAY_LIMITS,
    invalid_value,
    make_converter,
    structure,
    unsupported,
)

__all__ = [
    "EMBED_MAX_INPUTS",
    "ENCODING_FORMATS",
    "POOLING_NAMES",
    "EmbeddingCodec",
    "EmbeddingData",
    "EmbeddingInput",
    "EmbeddingList",
    "EmbeddingRequest",
    "EmbeddingUsage",
    "LlamaEmbedding",
    "LlamaEmbeddingRequest",
]

# The most inputs one request may hold (OpenAI's limit; the body's size limit and the
# token bound each input and the whole request are held to come first for long ones):
# the limit `structure` holds every protocol's top-level `input` array to, which
# `parse_inputs` applies to llama-server's `content` too.
EMBED_MAX_INPUTS = ARRAY_LIMITS["input"]
ENCODING_FORMATS = ("float", "base64")
POOLING_NAMES = ("mean", "last", "cls", "none")
# llama.cpp's embd_normalize: -1 none, 0 max absolute (int16's range), 1 taxicab,
# 2 euclidean, p > 2 the p-norm; bounded here so that |x|^p stays finite.
NORMALIZE_MAX = 64

_INPUT_DOC = (
    "a text, an array of token ids, an array mixing texts and token ids (one input, in "
    "order), an object {prompt_string} or {content: [text parts]}, or an array of these "
    f"(at most {EMBED_MAX_INPUTS})"
)
_INPUT_SCHEMA = schema(
    description=_INPUT_DOC,
    anyOf=[
        {"type": "string"},
        {"type": "array", "maxItems": EMBED_MAX_INPUTS},
        {"type": "object"},
    ],
)

Piece = str | int  # a text to tokenize, or a token id


@attrs.frozen
class EmbeddingInput:
    """One input: its pieces in order (texts and token ids), and where the request gave
    it (`param`, for a refusal that names it)."""

    pieces: tuple[Piece, ...]
    param: str


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    """POST /v1/embeddings: OpenAI's fields, llama-server's `embd_normalize`, vLLM's
    `truncate_prompt_tokens`, and ninfer's `pooling`."""

    input: Any = attrs.field(metadata=_INPUT_SCHEMA)
    model: str | None = None  # a served name (checked), or none: the served model
    # float (a JSON array of numbers) or base64 (the float32 values' little-endian bytes)
    encoding_format: str | None = attrs.field(
        default=None, metadata=schema(enum=list(ENCODING_FORMATS))
    )
    # Only the model's own width: a model served here cannot shorten its vectors.
    dimensions: int | None = attrs.field(default=None, metadata=schema(minimum=1))
    user: str | None = attrs.field(default=None, metadata=schema(maxLength=256))  # no effect
    embd_normalize: int | None = attrs.field(
        default=None, metadata=schema(minimum=-1, maximum=NORMALIZE_MAX)
    )
    # Each input cut to its last k tokens (-1: to the context) instead of refused when
    # longer than the context.
    truncate_prompt_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    # Over --pooling for this request: mean, last, cls (none only on llama-server's routes)
    pooling: str | None = attrs.field(default=None, metadata=schema(enum=list(POOLING_NAMES)))

    def inputs(self) -> list[EmbeddingInput]:
        return parse_inputs(self.input, "input")


@attrs.frozen(kw_only=True)
class LlamaEmbeddingRequest:
    """POST /embedding and /embeddings (llama-server's): `content` (or `input`), and
    the same options as /v1/embeddings but the encoding (its answer is numbers)."""

    content: Any = attrs.field(default=None, metadata=_INPUT_SCHEMA)
    input: Any = attrs.field(default=None, metadata=_INPUT_SCHEMA)
    model: str | None = None
    embd_normalize: int | None = attrs.field(
        default=None, metadata=schema(minimum=-1, maximum=NORMALIZE_MAX)
    )
    truncate_prompt_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=-1))
    pooling: str | None = attrs.field(default=None, metadata=schema(enum=list(POOLING_NAMES)))

    def inputs(self) -> list[EmbeddingInput]:
        if self.input is not None:
            return parse_inputs(self.input, "input")
        return parse_inputs(self.content, "content")


def parse_inputs(value: Any, param: str) -> list[EmbeddingInput]:
    """The request's inputs, as llama-server reads `input`: an array that holds a number
    is one input (token ids, or a mix of ids and texts); any other array is one input an
    entry; a text or an object is one input."""
    if value is None:
        raise invalid_value(param, f"{param} is required", code="missing_required_parameter")
    if isinstance(value, list):
        if not value:
            raise invalid_value(param, f"{param} must not be empty")
        if len(value) > EMBED_MAX_INPUTS:
            raise invalid_value(
                param,
                f"{param} has {len(value)} entries; at most {EMBED_MAX_INPUTS} are accepted",
                code="array_above_max_length",
            )
        if any(_is_id(v) for v in value):
            return [_one(value, param)]
        return [_one(v, f"{param}[{i}]") for i, v in enumerate(value)]
    return [_one(value, param)]


def _is_id(value: Any) -> bool:
    return type(value) is int


def _one(value: Any, param: str) -> EmbeddingInput:
    if isinstance(value, str):
        return EmbeddingInput((value,), param)
    if isinstance(value, list):
        if not value:
            raise invalid_value(param, f"{param} must not be empty")
        for i, piece in enumerate(value):
            if not (_is_id(piece) or isinstance(piece, str)):
                raise invalid_value(
                    f"{param}[{i}]",
                    f"{param}[{i}] must be a token id (an integer) or a text",
                    code="invalid_type",
                )
        return EmbeddingInput(tuple(value), param)
    if isinstance(value, dict):
        return EmbeddingInput((_object_text(value, param),), param)
    raise invalid_value(
        param,
        f"{param} must be a text, an array of token ids or texts, or an object",
        code="invalid_type",
    )


def _object_text(value: dict[str, Any], param: str) -> str:
    """An object input's text: `prompt_string`, or `content` as an array of text parts
    (joined); media parts are refused by name (no model served here reads them)."""
    unknown = sorted(set(value) - {"prompt_string", "content", "multimodal_data"})
    if unknown:
        raise invalid_value(
            f"{param}.{unknown[0]}", f"{param}.{unknown[0]} is not a known field of an input",
            code="unknown_parameter",
        )  # fmt: skip
    if value.get("multimodal_data") is not None:
        raise unsupported(
            f"{param}.multimodal_data", "the served model reads text only: no media input"
        )
    if "prompt_string" in value:
        text = value["prompt_string"]
        if not isinstance(text, str):
            raise invalid_value(f"{param}.prompt_string", "prompt_string must be a text",
                                code="invalid_type")  # fmt: skip
        return text
    parts = value.get("content")
    where = f"{param}.content"
    if not isinstance(parts, list) or not parts:
        raise invalid_value(where, f"{where} must be a non-empty array of text parts",
                            code="invalid_type")  # fmt: skip
    texts = []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_audio", "input_video", "file"):
            raise unsupported(f"{at}.type", f"the served model reads text only: no {kind} part")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise invalid_value(at, f"{at} must be a text part ({{type: text, text}})")
        texts.append(part["text"])
    return "".join(texts)


# ---- answers -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EmbeddingData:
    object: Literal["embedding"] = tag("embedding")
    index: int
    embedding: list[float] | str  # str: base64 of the float32 values, little-endian


@attrs.frozen(kw_only=True)
class EmbeddingUsage:
    prompt_tokens: int
    total_tokens: int


@attrs.frozen(kw_only=True)
class EmbeddingList:
    """/v1/embeddings' answer: one vector an input, in the inputs' order."""

    object: Literal["list"] = tag("list")
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


@attrs.frozen(kw_only=True)
class LlamaEmbedding:
    """One input's entry in llama-server's /embedding answer (a JSON array of these):
    its pooled vector as the one row, or with pooling none one row a token."""

    index: int
    embedding: list[list[float]]


class EmbeddingCodec:
    def __init__(self) -> None:
        conv = make_converter()
        conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)
        self._conv: cattrs.Converter = conv

    def parse(self, body: Any) -> EmbeddingRequest:
        req = structure(self._conv, body, EmbeddingRequest)
        _check(req)
        return req

    def parse_llama(self, body: Any) -> LlamaEmbeddingRequest:
        req = structure(self._conv, body, LlamaEmbeddingRequest)
        if req.input is None and req.content is None:
            raise invalid_value("content", "content (or input) is required",
                                code="missing_required_parameter")  # fmt: skip
        _check(req)
        return req


def _check(req: EmbeddingRequest | LlamaEmbeddingRequest) -> None:
    fmt = req.encoding_format if isinstance(req, EmbeddingRequest) else None
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise invalid_value("encoding_format", "encoding_format is 'float' or 'base64'")
    if req.pooling is not None and req.pooling not in POOLING_NAMES:
        raise invalid_value("pooling", "pooling is one of 'mean', 'last', 'cls', 'none'")
    if req.truncate_prompt_tokens == 0:
        raise invalid_value(
            "truncate_prompt_tokens",
            "truncate_prompt_tokens must be at least 1, or -1 (the context's length)",
        )
    check_limits(req)
