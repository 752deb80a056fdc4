"""The native contract: POST /v1/generate.

Request fields (strict JSON types, unknown fields refused):
  prompt          non-empty string
  max_new_tokens  integer >= 1 (default: the server's --default-max-tokens)
  temperature     number 0..2; 0 is greedy (default: the server's)
  top_k           integer >= 0; 0 is off
  top_p           number in (0, 1]
  min_p           number in [0, 1)
  seed            integer 0..2^31-1
  stop            array of up to 4 strings, each 1..32 characters
  stream          boolean
  ignore_eos      boolean: keep generating past end-of-sequence (benchmarks)

Errors: `{"error": {"type", "message", "param", "request_id"}}` with the status of
`protocols._errors.KINDS`.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from protocols._errors import ApiError
from protocols._schema import check_limits, schema
from protocols._strict import make_converter, register_list, structure

__all__ = [
    "MAX_SEED",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "GenerateRequest",
    "NativeCodec",
    "TokenPiece",
    "TokenizeRequest",
    "TokenizeResponse",
]

MAX_STOPS = 4
MAX_STOP_CHARS = 32
MAX_SEED = 2**31 - 1


@attrs.frozen
class GenerateRequest:
    """A native generation request (POST /v1/generate)."""

    prompt: str = attrs.field(metadata=schema(minLength=1))
    max_new_tokens: int | None = attrs.field(default=None, metadata=schema(minimum=1))
    temperature: float | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=2))
    top_k: int | None = attrs.field(default=None, metadata=schema(minimum=0))
    top_p: float | None = attrs.field(default=None, metadata=schema(exclusiveMinimum=0, maximum=1))
    min_p: float | None = attrs.field(default=None, metadata=schema(minimum=0, exclusiveMaximum=1))
    seed: int | None = attrs.field(default=None, metadata=schema(minimum=0, maximum=MAX_SEED))
    stop: list[str] | None = attrs.field(
        default=None,
        metadata=schema(maxItems=MAX_STOPS, items={"minLength": 1, "maxLength": MAX_STOP_CHARS}),
    )
    stream: bool = False
    ignore_eos: bool = False
    # A JSON schema the output must match, enforced while decoding (as OpenAI's
    # response_format json_schema; `{}` or `{"type": "object"}`: any object).
    json_schema: dict[str, Any] | None = None


@attrs.frozen
class TokenizeRequest:
    """POST /tokenize, in llama.cpp's shape (`content`, `add_special`, `parse_special`,
    `with_pieces`) or vLLM's (`prompt`, `add_special_tokens`, `model`): one text,
    exactly."""

    content: str | None = None
    prompt: str | None = None
    model: str | None = None
    add_special: bool | None = None  # llama.cpp's; default false
    add_special_tokens: bool | None = None  # vLLM's; default true
    # llama.cpp's; default true: control tokens' texts in it are those tokens (false:
    # plain text, as a chat message's are)
    parse_special: bool = True
    with_pieces: bool = False
    messages: list[Any] | None = None  # vLLM's chat form: refused, by name

    def text(self) -> tuple[str, str]:
        """(the text, the field it came in)."""
        if self.content is not None:
            return self.content, "content"
        assert self.prompt is not None  # checked by the codec
        return self.prompt, "prompt"

    def bos(self) -> bool:
        """Whether the model's BOS token (where it wants one) comes first."""
        if self.add_special is not None:
            return self.add_special
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None  # each shape's own default


@attrs.frozen
class TokenPiece:
    """A token and its text; llama.cpp's shape: a string where the token's bytes are
    valid UTF-8 on their own, else the bytes (a byte-level token holding part of a
    character: `[229]`)."""

    id: int
    piece: str | list[int]


@attrs.frozen
class TokenizeResponse:
    """Both servers' answers in one: llama.cpp's `tokens` (ids, or {id, piece} with
    with_pieces) and vLLM's `count`, `max_model_len` (and its `tokens`)."""

    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int


@attrs.frozen
class DetokenizeRequest:
    """POST /detokenize: llama.cpp's and vLLM's shape (`tokens`; vLLM's `model`)."""

    tokens: list[int] = attrs.field(metadata=schema(items={"minimum": 0}))
    model: str | None = None


@attrs.frozen
class DetokenizeResponse:
    """llama.cpp's `content` and vLLM's `prompt`: the same text."""

    content: str
    prompt: str


class NativeCodec:
    """Parses native requests with its own strict converter (one per app, never global)."""

    def __init__(self) -> None:
        self._conv = make_converter()
        register_list(self._conv, str)
        register_list(self._conv, int)

    def parse_generate(self, body: Any) -> GenerateRequest:
        return parse_generate(self._conv, body)

    def parse_tokenize(self, body: Any) -> TokenizeRequest:
        req = structure(self._conv, body, TokenizeRequest)
        if req.messages is not None:
            raise ApiError(
                "invalid_request",
                "messages are not tokenized here: send the text (content or prompt); a "
                "chat's prompt is counted by /v1/messages/count_tokens",
                param="messages",
                code="unsupported_parameter",
            )
        if (req.content is None) == (req.prompt is None):
            raise ApiError(
                "invalid_request",
                "send the text to tokenize as content (llama.cpp) or as prompt (vLLM), once",
                param="content",
            )
        return req

    def parse_detokenize(self, body: Any) -> DetokenizeRequest:
        return structure(self._conv, body, DetokenizeRequest)


def parse_generate(conv: cattrs.Converter, body: Any) -> GenerateRequest:
    """Structure and range-check a parsed body; raise ApiError naming the parameter."""
    if isinstance(body, dict):
        for key in ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens", "stop"):
            if key in body and body[key] is None:
                raise ApiError(
                    "invalid_request",
                    f"{key} must not be null; omit it to use the default",
                    param=key,
                    code="invalid_type",
                )
    req = structure(conv, body, GenerateRequest)
    # Above the context is the budget's to refuse (context_length_exceeded, with numbers).
    check_limits(req)
    return req
