"""`ninfer probe URL`: awkward requests against any ninfer deployment, as a table of data.

Each row is one request and what the documented contract says must come back:
the status, the error type as the route's protocol writes it, and the parameter
named. Every row is also checked for what holds of every answer: no 5xx, no
connection reset, the protocol's error envelope, a request id (header, and body
where the protocol has one), a bounded error body, and nothing of the input
echoed (each body carries a canary value that must not come back).

The expected wire types below are written out from docs/errors.md and docs/api.md,
independently of the server's own mapping, so the table checks the server rather
than restating it.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Literal

import attrs
import orjson

from ninfer.tools._args import positive_float, positive_int

__all__ = [
    "PROBES",
    "Probe",
    "ProbeEnv",
    "ProbeResult",
    "add_command",
    "probe_table",
    "run_probes",
]

Route = Literal["native", "chat", "completions", "messages", "count_tokens", "responses", "other"]
# plain: one body; chunked: Transfer-Encoding chunked; declared: an oversized declared
# length with only its start sent; head: the status and headers only (a stream that
# would run long is closed once they arrive, which cancels it).
Transport = Literal["plain", "chunked", "declared", "head"]

CANARY = "zq-canary-7f3a"
MAX_ERROR_BODY = 4096

PATHS: dict[Route, str] = {
    "native": "/v1/generate",
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "responses": "/v1/responses",
}

# kind -> status on the native route (docs/errors.md, "The status rule").
_NATIVE_STATUS = {
    "malformed_json": 400, "unauthorized": 401, "not_found": 404, "model_not_found": 404,
    "method_not_allowed": 405, "payload_too_large": 413, "unsupported_media_type": 415,
    "invalid_request": 422, "context_length_exceeded": 422,
}  # fmt: skip
# OpenAI and Anthropic routes: 400 for anything invalid (docs/errors.md, docs/api.md).
_INVALID_400 = {"malformed_json", "invalid_request", "context_length_exceeded"}
_OPENAI_TYPE: dict[str, str] = {}  # invalid_request_error for every client fault, 401 too
_OPENAI_CODE = {
    "unauthorized": "invalid_api_key", "model_not_found": "model_not_found",
    "context_length_exceeded": "context_length_exceeded",
}  # fmt: skip
_ANTHROPIC_TYPE = {
    "unauthorized": "authentication_error", "not_found": "not_found_error",
    "model_not_found": "not_found_error", "payload_too_large": "request_too_large",
}  # fmt: skip


@attrs.frozen
class ProbeEnv:
    """What a probe needs to know about the deployment."""

    model: str  # a served model id (from GET /v1/models)
    max_request_bytes: int = 4 << 20
    api_key: str | None = None
    chat: bool = True  # the model has a chat template (a base model may have none)


Body = bytes | Callable[[ProbeEnv], bytes]


@attrs.frozen
class Probe:
    name: str
    route: Route
    body: Body
    status: int
    kind: str | None  # the ApiError kind expected; None for a success
    param: str | None = None
    method: str = "POST"
    path: str | None = None  # overrides the route's path
    content_type: str | None = "application/json"
    auth: Literal["key", "none", "wrong"] = "key"
    transport: Transport = "plain"
    header: str | None = None  # a response header the answer must carry

    @property
    def url_path(self) -> str:
        return self.path or PATHS.get(self.route, "/")

    def expected(self) -> tuple[int, str | None]:
        """(status, error type as the protocol writes it)."""
        kind = self.kind
        if kind is None:
            return self.status, None
        if _route_of_openai(self):
            status = 400 if kind in _INVALID_400 else self.status
            return status, _OPENAI_TYPE.get(kind, "invalid_request_error")
        if self.route in ("messages", "count_tokens"):
            status = 400 if kind in _INVALID_400 else self.status
            return status, _ANTHROPIC_TYPE.get(kind, "invalid_request_error")
        return self.status, kind


@attrs.define
class ProbeResult:
    probe: Probe
    status: int | None = None
    problems: list[str] = attrs.field(factory=list)
    skipped: str | None = None  # why the probe was not sent

    @property
    def ok(self) -> bool:
        return not self.problems


# ---- the table ----------------------------------------------------------------------------


def _j(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _base(route: Route, model: str) -> dict[str, Any]:
    """A valid one-token request for the route, carrying the canary in its text."""
    text = f"Say hi ({CANARY})"
    if route == "native":
        return {"prompt": text, "max_new_tokens": 1}
    if route == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if route == "completions":
        return {"model": model, "prompt": text, "max_tokens": 1}
    if route == "count_tokens":
        return {"model": model, "messages": [{"role": "user", "content": text}]}
    if route == "responses":
        # 16 tokens at least (the Responses API's floor): enough for a model to repeat
        # its input, so the input carries no canary (the refusals' fields still do).
        return {"model": model, "input": "Say hi", "max_output_tokens": 16}
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


# A function tool, for the probes of tool choices.
_FUNCTION = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
    "additionalProperties": False}}}  # fmt: skip


def _with(route: Route, **changes: Any) -> Callable[[ProbeEnv], bytes]:
    """The route's valid body with fields set (`_DROP` removes one)."""

    def build(env: ProbeEnv) -> bytes:
        body = _base(route, env.model)
        for key, value in changes.items():
            if value is _DROP:
                body.pop(key, None)
            else:
                body[key] = value
        return _j(body)

    return build


def _raw(route: Route, fragment: str) -> Callable[[ProbeEnv], bytes]:
    """The route's valid body with raw JSON text spliced in as a last field."""

    def build(env: ProbeEnv) -> bytes:
        text = _j(_base(route, env.model)).decode()
        return (text[:-1] + "," + fragment + "}").encode()

    return build


_DROP = object()
_GEN: tuple[Route, ...] = ("native", "chat", "completions", "messages", "responses")
_MAX_FIELD: dict[Route, str] = {
    "native": "max_new_tokens", "chat": "max_tokens", "completions": "max_tokens",
    "messages": "max_tokens", "count_tokens": "model", "responses": "max_output_tokens",
}  # fmt: skip
_PROMPT_FIELD = {"native": "prompt", "completions": "prompt", "chat": "messages",
                 "messages": "messages", "responses": "input"}  # fmt: skip


def _long_prompt(route: Route, unit: str, count: int) -> Callable[[ProbeEnv], bytes]:
    def build(env: ProbeEnv) -> bytes:
        text = unit * count
        if route in ("native", "completions"):
            return _with(route, prompt=text)(env)
        if route == "responses":
            return _with(route, input=text)(env)
        return _with(route, messages=[{"role": "user", "content": text}])(env)

    return build


def _nested(depth: int) -> Callable[[ProbeEnv], bytes]:
    def build(env: ProbeEnv) -> bytes:
        return ("[" * depth + "]" * depth).encode()

    return build


def _oversized(env: ProbeEnv) -> bytes:
    """Half as large again as the limit: past it by more than any buffer."""
    return b'{"prompt": "' + b"a" * (env.max_request_bytes * 3 // 2) + b'"}'


def _rows() -> Iterator[Probe]:
    # Bodies that are not a JSON object, on every generation route.
    for r in _GEN:
        yield Probe(f"{r}: empty body", r, b"", 400, "malformed_json")
        yield Probe(f"{r}: not JSON", r, b"{prompt: " + CANARY.encode() + b"}", 400,
                    "malformed_json")  # fmt: skip
        yield Probe(f"{r}: an array", r, b'["' + CANARY.encode() + b'"]', 422, "invalid_request")
        yield Probe(f"{r}: a string", r, b'"' + CANARY.encode() + b'"', 422, "invalid_request")
        yield Probe(f"{r}: NaN literal", r, _raw(r, '"temperature": NaN'), 400, "malformed_json")
        yield Probe(f"{r}: Infinity literal", r, _raw(r, '"temperature": Infinity'), 400,
                    "malformed_json")  # fmt: skip
        yield Probe(f"{r}: lone surrogate", r, _raw(r, '"x": "\\ud800' + CANARY + '"'), 400,
                    "malformed_json")  # fmt: skip
        yield Probe(f"{r}: invalid UTF-8", r, b'{"prompt": "\xff\xfe' + CANARY.encode() + b'"}',
                    400, "malformed_json")  # fmt: skip
        yield Probe(f"{r}: nested 20000 deep", r, _nested(20000), 400, "malformed_json")
        yield Probe(f"{r}: text/plain", r, _with(r), 415, "unsupported_media_type",
                    content_type="text/plain")  # fmt: skip
        yield Probe(f"{r}: no content type", r, _with(r), 415, "unsupported_media_type",
                    content_type=None)  # fmt: skip
        yield Probe(f"{r}: GET", r, b"", 405, "method_not_allowed", method="GET")
        yield Probe(f"{r}: over the size limit, declared", r, _oversized, 413,
                    "payload_too_large", transport="declared")  # fmt: skip
        yield Probe(f"{r}: over the size limit, chunked", r, _oversized, 413,
                    "payload_too_large", transport="chunked")  # fmt: skip
        yield Probe(f"{r}: no API key", r, _with(r), 401, "unauthorized", auth="none")
        yield Probe(f"{r}: wrong API key", r, _with(r), 401, "unauthorized", auth="wrong")
        # Unknown and misspelt fields.
        yield Probe(f"{r}: unknown field", r, _with(r, **{"frobnicate": CANARY}), 422,
                    "invalid_request", "frobnicate")  # fmt: skip
        yield Probe(f"{r}: misspelt field", r, _with(r, temprature=0.5), 422, "invalid_request",
                    "temprature")  # fmt: skip
        # The output budget: wrong JSON types, out of range.
        mf = _MAX_FIELD[r]
        for label, value in (("a string", "5"), ("a float", 5.0), ("a boolean", True),
                             ("null", None), ("an object", {"n": CANARY})):  # fmt: skip
            if value is None and r != "native":
                continue  # OpenAI/Anthropic clients send null for "default": covered below
            yield Probe(f"{r}: {mf} {label}", r, _with(r, **{mf: value}), 422,
                        "invalid_request", mf)  # fmt: skip
        yield Probe(f"{r}: {mf} zero", r, _with(r, **{mf: 0}), 422, "invalid_request", mf)
        # (-1 on the OpenAI chat and text routes is llama-server's "up to the room left")
        negative = -2 if r in ("chat", "completions") else -1
        yield Probe(f"{r}: {mf} negative", r, _with(r, **{mf: negative}), 422,
                    "invalid_request", mf)  # fmt: skip
        # Past the context: the native route refuses; the OpenAI and Anthropic routes
        # serve what the context leaves (their clients send large defaults).
        for label, big in (("2^63", 2**63), ("past the context", 10**7)):
            if r == "native":
                yield Probe(f"{r}: {mf} {label}", r, _with(r, **{mf: big}), 422,
                            "context_length_exceeded", mf)  # fmt: skip
            else:  # served, clamped: a stream, closed once its headers say so
                yield Probe(f"{r}: {mf} {label}", r, _with(r, **{mf: big, "stream": True}),
                            200, None, transport="head",
                            header="x-ninfer-max-tokens-clamped")  # fmt: skip
        # Sampling fields.
        yield Probe(f"{r}: temperature a string", r, _with(r, temperature="0.5"), 422,
                    "invalid_request", "temperature")  # fmt: skip
        yield Probe(f"{r}: temperature negative", r, _with(r, temperature=-1), 422,
                    "invalid_request", "temperature")  # fmt: skip
        yield Probe(f"{r}: top_p above 1", r, _with(r, top_p=1.5), 422, "invalid_request",
                    "top_p")  # fmt: skip
        yield Probe(f"{r}: stream a string", r, _with(r, stream="yes"), 422, "invalid_request",
                    "stream")  # fmt: skip
        # Prompts over the budget, in characters and in tokens.
        pf = _PROMPT_FIELD[r]
        for label, unit, count in (("emoji", "\U0001f600", 120_000), ("CJK", "漢字", 120_000),
                                   ("spaces", " x", 200_000)):  # fmt: skip
            yield Probe(f"{r}: prompt of {label} over the context", r,
                        _long_prompt(r, unit, count), 422, "context_length_exceeded",
                        pf)  # fmt: skip
        # Well-formed oddities that must be served.
        yield Probe(f"{r}: NUL in the prompt", r, _long_prompt(r, "a\u0000b ", 2), 200, None)
        yield Probe(f"{r}: integer temperature", r, _with(r, temperature=0), 200, None)
    # Native specifics.
    yield Probe("native: prompt missing", "native", _with("native", prompt=_DROP), 422,
                "invalid_request", "prompt")  # fmt: skip
    yield Probe("native: prompt empty", "native", _with("native", prompt=""), 422,
                "invalid_request", "prompt")  # fmt: skip
    yield Probe("native: prompt a number", "native", _with("native", prompt=5), 422,
                "invalid_request", "prompt")  # fmt: skip
    yield Probe("native: too many stop strings", "native",
                _with("native", stop=["a", "b", "c", "d", "e"]), 422, "invalid_request",
                "stop")  # fmt: skip
    yield Probe("native: stop item a number", "native", _with("native", stop=["a", 5]), 422,
                "invalid_request", "stop[1]")  # fmt: skip
    yield Probe("native: seed negative", "native", _with("native", seed=-3), 422,
                "invalid_request", "seed")  # fmt: skip
    yield Probe("native: top_k a float", "native", _with("native", top_k=2.5), 422,
                "invalid_request", "top_k")  # fmt: skip
    # OpenAI chat specifics.
    for r in ("chat", "messages"):
        yield Probe(f"{r}: messages missing", r, _with(r, messages=_DROP), 422,
                    "invalid_request", "messages")  # fmt: skip
        yield Probe(f"{r}: messages empty", r, _with(r, messages=[]), 422, "invalid_request",
                    "messages")  # fmt: skip
        yield Probe(f"{r}: invalid role", r,
                    _with(r, messages=[{"role": "wizard", "content": CANARY}]), 422,
                    "invalid_request", "messages[0].role")  # fmt: skip
        yield Probe(f"{r}: content a number", r,
                    _with(r, messages=[{"role": "user", "content": 5}]), 422,
                    "invalid_request", "messages[0].content")  # fmt: skip
        if r == "chat":  # the served model, as llama-server and vLLM answer
            yield Probe(f"{r}: model missing", r, _with(r, model=_DROP), 200, None)
        else:
            yield Probe(f"{r}: model missing", r, _with(r, model=_DROP), 422,
                        "invalid_request", "model")  # fmt: skip
    # Tools: malformed tools, choices and replayed calls are refused by name (the
    # client's text never echoed).
    yield Probe("chat: a tool without its function", "chat",
                _with("chat", tools=[{"type": "function"}]), 422, "invalid_request",
                "tools[0].function")  # fmt: skip
    yield Probe("chat: tool_choice names no tool", "chat",
                _with("chat", tools=[_FUNCTION], tool_choice={
                    "type": "function", "function": {"name": CANARY[:40]}}), 422,
                "invalid_request", "tool_choice.function.name")  # fmt: skip
    yield Probe("chat: a tool schema that cannot be enforced", "chat",
                _with("chat", tools=[{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "object", "not": {CANARY: 1}}}}]),
                422, "invalid_request", "tools[0].function.parameters")  # fmt: skip
    yield Probe("chat: replayed call arguments not JSON", "chat",
                _with("chat", messages=[{"role": "user", "content": "hi"},
                                        {"role": "assistant", "tool_calls": [
                                            {"id": "c1", "type": "function", "function": {
                                                "name": "f", "arguments": CANARY}}]}]),
                422, "invalid_request",
                "messages[1].tool_calls[0].function.arguments")  # fmt: skip
    yield Probe("messages: a tool without input_schema", "messages",
                _with("messages", tools=[{"name": "f"}]), 422, "invalid_request",
                "tools[0].input_schema")  # fmt: skip
    yield Probe("messages: tool_result in an assistant turn", "messages",
                _with("messages", messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": CANARY}]},
                    {"role": "user", "content": "go on"}]),
                422, "invalid_request", "messages[1].content[0].type")  # fmt: skip
    yield Probe("chat: tool message without its id", "chat",
                _with("chat", messages=[{"role": "user", "content": "hi"},
                                        {"role": "tool", "content": CANARY}]),
                422, "invalid_request", "messages[1].tool_call_id")  # fmt: skip
    yield Probe("chat: max_tokens and max_completion_tokens differ", "chat",
                _with("chat", max_tokens=1, max_completion_tokens=2), 422, "invalid_request",
                "max_tokens")  # fmt: skip
    yield Probe("chat: n past any server's running slots", "chat", _with("chat", n=128), 422,
                "invalid_request", "n")  # fmt: skip
    yield Probe("chat: top_logprobs past 20", "chat",
                _with("chat", logprobs=True, top_logprobs=21), 422, "invalid_request",
                "top_logprobs")  # fmt: skip
    yield Probe("chat: top_logprobs without logprobs", "chat", _with("chat", top_logprobs=2),
                422, "invalid_request", "top_logprobs")  # fmt: skip
    yield Probe("chat: logit_bias key not a token id", "chat",
                _with("chat", logit_bias={CANARY: 5}), 422, "invalid_request",
                "logit_bias")  # fmt: skip
    yield Probe("chat: logit_bias past 100", "chat", _with("chat", logit_bias={"1": 101}), 422,
                "invalid_request", "logit_bias")  # fmt: skip
    yield Probe("chat: reasoning_effort of no level", "chat",
                _with("chat", reasoning_effort=CANARY), 422, "invalid_request",
                "reasoning_effort")  # fmt: skip
    yield Probe("chat: metadata value a number", "chat", _with("chat", metadata={"k": 5}), 422,
                "invalid_request", "metadata")  # fmt: skip
    yield Probe("chat: response format of no type", "chat",
                _with("chat", response_format={"type": "xml"}), 422, "invalid_request",
                "response_format.type")  # fmt: skip
    yield Probe("chat: json_schema without a name", "chat",
                _with("chat", response_format={"type": "json_schema",
                                               "json_schema": {"schema": {"type": "object"}}}),
                422, "invalid_request", "response_format.json_schema.name")  # fmt: skip
    yield Probe("chat: json_schema the engine cannot enforce", "chat",
                _with("chat", response_format={"type": "json_schema", "json_schema": {
                    "name": "s", "schema": {"type": "array", "uniqueItems": True}}}),
                422, "invalid_request", "response_format.json_schema.schema")  # fmt: skip
    yield Probe("chat: json object served", "chat",
                _with("chat", response_format={"type": "json_object"}), 200, None)  # fmt: skip
    yield Probe("chat: image part", "chat",
                _with("chat", messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://x/" + CANARY}}]}]),
                422, "invalid_request", "messages[0].content[0].type")  # fmt: skip
    yield Probe("chat: part of an unknown type", "chat",
                _with("chat", messages=[{"role": "user", "content": [{"type": CANARY}]}]),
                422, "invalid_request", "messages[0].content[0].type")  # fmt: skip
    yield Probe("chat: unknown field with a long name", "chat",
                _with("chat", **{CANARY * 300: 1}), 422, "invalid_request",
                "<invalid name>")  # fmt: skip
    yield Probe("chat: wrong model", "chat", _with("chat", model="no-such-" + CANARY), 404,
                "model_not_found", "model")  # fmt: skip
    yield Probe("completions: wrong model", "completions",
                _with("completions", model="no-such-" + CANARY), 404, "model_not_found",
                "model")  # fmt: skip
    yield Probe("completions: logprobs past 5", "completions", _with("completions", logprobs=6),
                422, "invalid_request", "logprobs")  # fmt: skip
    yield Probe("completions: suffix", "completions", _with("completions", suffix=CANARY), 422,
                "invalid_request", "suffix")  # fmt: skip
    yield Probe("completions: token id outside the vocabulary", "completions",
                _with("completions", prompt=[[1, 2**40]]), 422, "invalid_request",
                "prompt[0]")  # fmt: skip
    yield Probe("completions: prompt a list of mixed items", "completions",
                _with("completions", prompt=["a", 1]), 422, "invalid_request",
                "prompt[0]")  # fmt: skip
    yield Probe("completions: empty prompt in a list", "completions",
                _with("completions", prompt=["a", ""]), 422, "invalid_request",
                "prompt[1]")  # fmt: skip
    # Anthropic specifics.
    yield Probe("messages: max_tokens missing", "messages", _with("messages", max_tokens=_DROP),
                422, "invalid_request", "max_tokens")  # fmt: skip
    yield Probe("messages: assistant prefill", "messages",
                _with("messages", messages=[{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": CANARY}]),
                422, "invalid_request", "messages[1].role")  # fmt: skip
    yield Probe("messages: temperature above 1", "messages", _with("messages", temperature=1.5),
                422, "invalid_request", "temperature")  # fmt: skip
    yield Probe("messages: output_config", "messages",
                _with("messages", output_config={"effort": "low"}), 422, "invalid_request",
                "output_config")  # fmt: skip
    yield Probe("messages: image block", "messages",
                _with("messages", messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "data": CANARY}}]}]),
                422, "invalid_request", "messages[0].content[0].type")  # fmt: skip
    yield Probe("messages: block of an unknown type", "messages",
                _with("messages", messages=[{"role": "user", "content": [{"type": CANARY}]}]),
                422, "invalid_request", "messages[0].content[0].type")  # fmt: skip
    yield Probe("native: unknown field with a long name", "native",
                _with("native", **{CANARY * 300: 1}), 422, "invalid_request",
                "<invalid name>")  # fmt: skip
    yield Probe("count_tokens: messages missing", "count_tokens",
                _with("count_tokens", messages=_DROP), 422, "invalid_request",
                "messages")  # fmt: skip
    yield Probe("count_tokens: served", "count_tokens", _with("count_tokens"), 200, None)
    # OpenAI Responses specifics.
    yield Probe("responses: json_schema format without a name", "responses",
                _with("responses", text={"format": {"type": "json_schema", "schema": {}}}),
                422, "invalid_request", "text.format.name")  # fmt: skip
    yield Probe("responses: Item of an unknown type", "responses",
                _with("responses", input=[{"type": CANARY, "role": "user", "content": "hi"}]),
                422, "invalid_request", "input[0].type")  # fmt: skip
    yield Probe("responses: reasoning Item, encrypted", "responses",
                _with("responses", input=[{"type": "reasoning", "id": "rs_1", "summary": [],
                                           "encrypted_content": CANARY}]),
                422, "invalid_request", "input[0].encrypted_content")  # fmt: skip
    yield Probe("responses: image part", "responses",
                _with("responses", input=[{"role": "user", "content": [
                    {"type": "input_image", "image_url": "http://x/" + CANARY}]}]),
                422, "invalid_request", "input[0].content[0].type")  # fmt: skip
    yield Probe("responses: duplicate Item ids", "responses",
                _with("responses", input=[{"role": "user", "content": "a", "id": CANARY},
                                          {"role": "user", "content": "b", "id": CANARY}]),
                422, "invalid_request", "input[1].id")  # fmt: skip
    yield Probe("responses: input empty", "responses", _with("responses", input=[]), 422,
                "invalid_request", "input")  # fmt: skip
    yield Probe("responses: unknown previous_response_id", "responses",
                _with("responses", previous_response_id="resp_" + CANARY), 404, "not_found",
                "previous_response_id")  # fmt: skip
    yield Probe("responses: metadata with 17 pairs", "responses",
                _with("responses", metadata={f"k{i}": "v" for i in range(17)}), 422,
                "invalid_request", "metadata")  # fmt: skip
    yield Probe("responses: background", "responses", _with("responses", background=True), 422,
                "invalid_request", "background")  # fmt: skip
    yield Probe("responses: a hosted tool", "responses",
                _with("responses", tools=[{"type": "web_search"}]), 422,
                "invalid_request", "tools[0].type")  # fmt: skip
    yield Probe("responses: a function_call Item without its call_id", "responses",
                _with("responses", input=[{"type": "function_call", "name": "f",
                                           "arguments": "{}"}]), 422,
                "invalid_request", "input[0].call_id")  # fmt: skip
    yield Probe("responses: store off", "responses", _with("responses", store=False), 200,
                None)  # fmt: skip
    yield Probe("responses: a stored response that does not exist", "other", b"", 404,
                "not_found", method="GET", path="/v1/responses/resp_" + CANARY)  # fmt: skip
    yield Probe("responses: input_tokens served", "other",
                lambda env: _j({"model": env.model, "input": "hello"}), 200, None,
                path="/v1/responses/input_tokens")  # fmt: skip
    # Routes and methods.
    yield Probe("unknown path", "other", b"", 404, "not_found", method="GET",
                path="/v1/" + CANARY)  # fmt: skip
    yield Probe("unknown model card", "other", b"", 404, "model_not_found", "model",
                method="GET", path="/v1/models/" + CANARY)  # fmt: skip
    yield Probe("DELETE /v1/models", "other", b"", 405, "method_not_allowed", method="DELETE",
                path="/v1/models")  # fmt: skip
    yield Probe("PUT /health", "other", b"", 405, "method_not_allowed", method="PUT",
                path="/health", auth="none")  # fmt: skip
    yield Probe("GET /health", "other", b"", 200, None, method="GET", path="/health",
                auth="none")  # fmt: skip
    yield Probe("GET /metrics without a key", "other", b"", 401, "unauthorized", method="GET",
                path="/metrics", auth="none")  # fmt: skip


PROBES: tuple[Probe, ...] = tuple(_rows())


def probe_table() -> list[dict[str, Any]]:
    """The table as rows of plain data (for `ninfer probe --list`)."""
    return [
        {"name": p.name, "method": p.method, "path": p.url_path, "status": p.expected()[0],
         "type": p.expected()[1], "param": p.param, "transport": p.transport, "auth": p.auth}
        for p in PROBES
    ]  # fmt: skip


# ---- running ------------------------------------------------------------------------------


def _route_of_openai(probe: Probe) -> bool:
    return probe.route in ("chat", "completions", "responses") or probe.url_path.startswith(
        ("/v1/models", "/v1/responses")
    )


def check(
    probe: Probe, status: int, headers: dict[str, str], body: bytes, sent: bytes
) -> list[str]:
    """Everything wrong with one answer."""
    problems: list[str] = []
    want_status, want_type = probe.expected()
    if status >= 500:
        problems.append(f"5xx: {status}")
    if status != want_status:
        problems.append(f"status {status}, expected {want_status}")
    anthropic = probe.route in ("messages", "count_tokens")
    rid = headers.get("request-id" if anthropic else "x-request-id")
    if not rid:
        problems.append("no request id header")
    if CANARY.encode() in body:
        problems.append("the answer echoes the input")
    if probe.header is not None and probe.header not in headers:
        problems.append(f"no {probe.header} header")
    if want_type is None:
        return problems
    if len(body) > MAX_ERROR_BODY:
        problems.append(f"error body of {len(body)} bytes")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return [*problems, "error body is not JSON"]
    if anthropic:
        ok = (
            isinstance(doc, dict)
            and doc.get("type") == "error"
            and isinstance(doc.get("error"), dict)
            and set(doc["error"]) == {"type", "message"}
        )
        if not ok:
            return [*problems, "not Anthropic's error envelope"]
        err = doc["error"]
        if doc.get("request_id") != rid:
            problems.append("body request_id differs from the header")
        if probe.param is not None and not str(err["message"]).startswith(probe.param + ":"):
            problems.append(f"message does not start with the parameter {probe.param!r}")
    elif _route_of_openai(probe):
        err = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
            return [*problems, "not OpenAI's error envelope"]
        if err["param"] != probe.param:
            problems.append(f"param {err['param']!r}, expected {probe.param!r}")
        want_code = _OPENAI_CODE.get(str(probe.kind))
        if want_code is not None and err["code"] != want_code:
            problems.append(f"code {err['code']!r}, expected {want_code!r}")
    else:
        err = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(err, dict) or set(err) != {"type", "message", "param", "request_id"}:
            return [*problems, "not the native error envelope"]
        if err["request_id"] != rid:
            problems.append("body request_id differs from the header")
        if err["param"] != probe.param:
            problems.append(f"param {err['param']!r}, expected {probe.param!r}")
    if err["type"] != want_type:
        problems.append(f"type {err['type']!r}, expected {want_type!r}")
    if not isinstance(err.get("message"), str) or not err["message"]:
        problems.append("no message")
    if status in (429, 503) and "retry-after" not in headers:
        problems.append("no Retry-After")
    return problems


async def run_probes(
    base_url: str,
    env: ProbeEnv,
    *,
    probes: tuple[Probe, ...] = PROBES,
    concurrency: int = 4,
    timeout_s: float = 60.0,
    on_result: Callable[[ProbeResult], None] | None = None,
) -> list[ProbeResult]:
    """Send every probe (a few at a time) and check each answer."""
    import httpx
    import trio

    results: list[ProbeResult] = [ProbeResult(p) for p in probes]
    limiter = trio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:

        async def one(result: ProbeResult) -> None:
            async with limiter:
                await _run_one(client, base_url, env, result, timeout_s)
            if on_result is not None:
                on_result(result)

        async with trio.open_nursery() as nursery:
            for result in results:
                result.skipped = _skip(result.probe, env)
                if result.skipped is None:
                    nursery.start_soon(one, result)
    return results


# Routes that render the model's chat template.
_CHAT_ROUTES = frozenset({"chat", "messages", "count_tokens", "responses"})


def _skip(probe: Probe, env: ProbeEnv) -> str | None:
    """Why a probe cannot be judged on this deployment, or None."""
    if probe.status == 401 and env.api_key is None:
        return "the deployment has no API key"
    # Without a chat template a chat request that passes every check is refused when it
    # is rendered: what needs the rendered prompt cannot be probed.
    chat = probe.route in _CHAT_ROUTES or (probe.path or "").startswith("/v1/responses")
    if not env.chat and chat and (probe.status == 200 or probe.kind == "context_length_exceeded"):
        return "the model has no chat template"
    return None


def _headers(probe: Probe, env: ProbeEnv) -> dict[str, str]:
    headers: dict[str, str] = {}
    if probe.content_type is not None:
        headers["content-type"] = probe.content_type
    if probe.auth == "key" and env.api_key is not None:
        headers["authorization"] = f"Bearer {env.api_key}"
    elif probe.auth == "wrong":
        headers["authorization"] = "Bearer wrong-" + CANARY
    if probe.route in ("messages", "count_tokens"):
        headers["anthropic-version"] = "2023-06-01"
    return headers


async def _run_one(
    client: Any, base_url: str, env: ProbeEnv, result: ProbeResult, timeout_s: float
) -> None:
    import httpx

    probe = result.probe
    body = probe.body(env) if callable(probe.body) else probe.body
    headers = _headers(probe, env)
    try:
        if probe.transport == "declared":
            status, resp_headers, resp_body = await _declared(
                base_url, probe, headers, body, timeout_s
            )
        elif probe.transport == "head":
            async with client.stream(
                probe.method, probe.url_path, content=body, headers=headers
            ) as response:
                status = response.status_code
                resp_headers = {k.lower(): v for k, v in response.headers.items()}
                resp_body = b""
        else:
            content: Any = body
            if probe.transport == "chunked":
                content = _chunks(body)
            response = await client.request(
                probe.method, probe.url_path, content=content or None, headers=headers
            )
            status = response.status_code
            resp_headers = {k.lower(): v for k, v in response.headers.items()}
            resp_body = response.content
    except (httpx.HTTPError, OSError) as exc:
        result.problems.append(f"no answer: {type(exc).__name__}: {exc}")
        return
    result.status = status
    result.problems += check(probe, status, resp_headers, resp_body, body)


async def _chunks(body: bytes) -> Any:
    step = 64 * 1024
    for i in range(0, len(body), step):
        yield body[i : i + step]


async def _declared(
    base_url: str, probe: Probe, headers: dict[str, str], body: bytes, timeout_s: float
) -> tuple[int, dict[str, str], bytes]:
    """Declare the whole (oversized) Content-Length, send only its first bytes, and read
    the answer: the server must refuse by the declared size without waiting for the rest."""
    import h11
    import trio

    url = urllib.parse.urlsplit(base_url)
    host = url.hostname or "127.0.0.1"
    port = url.port or 80
    conn = h11.Connection(h11.CLIENT)
    head = [("host", f"{host}:{port}"), ("content-length", str(len(body)))]
    head += list(headers.items())
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(
                conn.send(h11.Request(method=probe.method, target=probe.url_path, headers=head))
                or b""
            )
            await stream.send_all(conn.send(h11.Data(data=body[:1024])) or b"")
            status = 0
            resp_headers: dict[str, str] = {}
            chunks: list[bytes] = []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    resp_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
    return status, resp_headers, b"".join(chunks)


# ---- the command ---------------------------------------------------------------------


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    probe = sub.add_parser(
        "probe",
        help="send awkward requests to a deployment and check every answer",
        description="Send the probe table (malformed, mistyped, oversized, unsupported and "
        "unauthorized requests to every generation route, plus a few that must succeed) and "
        "check each answer: the documented status, error type and parameter; no 5xx, no "
        "reset; the protocol's error envelope with a request id; a bounded body that echoes "
        "nothing of the input. Exit status 1 when any probe fails. Probes that need an API "
        "key to refuse are skipped when none is given, and those that need a rendered chat "
        "when the model has no chat template (a base model).",
    )
    probe.add_argument("url", nargs="?", help="the server, e.g. http://127.0.0.1:8080")
    probe.add_argument(
        "--api-key", default=None, help="the deployment's API key (default: $NINFER_API_KEY)"
    )
    probe.add_argument(
        "--max-request-mib",
        type=positive_float,
        default=4.0,
        help="the deployment's --max-request-mib, to size the oversized bodies (default: 4)",
    )
    probe.add_argument(
        "--concurrency", type=positive_int, default=4, help="probes in flight at once (default: 4)"
    )
    probe.add_argument(
        "--timeout", type=positive_float, default=60.0, help="seconds per probe (default: 60)"
    )
    probe.add_argument("--only", default=None, help="run only probes whose name contains this")
    probe.add_argument("--json", action="store_true", help="print every result as JSON")
    probe.add_argument(
        "--list", action="store_true", help="print the probe table (JSON lines) and exit"
    )
    probe.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    import httpx
    import trio

    if args.list:
        import orjson

        for row in probe_table():
            sys.stdout.write(orjson.dumps(row).decode() + "\n")
        return 0
    if args.url is None:
        print("ninfer probe: error: the URL is required (or --list)", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    key = args.api_key or os.environ.get("NINFER_API_KEY")
    probes = tuple(p for p in PROBES if not args.only or args.only in p.name)

    def on_result(result: ProbeResult) -> None:
        if not result.ok and not args.json:
            print(f"FAIL {result.probe.name}: {'; '.join(result.problems)}", file=sys.stderr)

    async def main() -> list[ProbeResult]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(base_url=base, timeout=args.timeout) as client:
            listing = await client.get("/v1/models", headers=headers)
            if listing.status_code != 200:
                hint = " (is --api-key needed?)" if listing.status_code == 401 else ""
                raise RuntimeError(f"GET /v1/models answered {listing.status_code}{hint}")
            model = listing.json()["data"][0]["id"]
            # A base model without a chat template refuses every chat with this code.
            hello = [{"role": "user", "content": "hi"}]
            tried = await client.post(
                "/v1/chat/completions",
                json={"model": model, "max_tokens": 1, "messages": hello},
                headers=headers,
            )
        no_template = tried.status_code == 400 and (
            (tried.json().get("error") or {}).get("code") == "no_chat_template"
        )
        env = ProbeEnv(
            model=model,
            max_request_bytes=int(args.max_request_mib * (1 << 20)),
            api_key=key,
            chat=not no_template,
        )
        return await run_probes(
            base,
            env,
            probes=probes,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            on_result=on_result,
        )

    try:
        results = trio.run(main)
    except (httpx.HTTPError, OSError, RuntimeError, KeyError, ValueError) as exc:
        print(f"ninfer probe: error: {base}: {exc}", file=sys.stderr)
        return 2
    sent = [r for r in results if r.skipped is None]
    failed = [r for r in sent if not r.ok]
    if args.json:
        import orjson

        rows = [
            {
                "name": r.probe.name,
                "status": r.status,
                "ok": r.ok,
                "problems": r.problems,
                "skipped": r.skipped,
            }
            for r in results
        ]
        sys.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    why = Counter(r.skipped for r in results if r.skipped is not None)
    skipped = "; ".join(f"{n} skipped: {reason}" for reason, n in why.items())
    print(
        f"{len(sent) - len(failed)} of {len(sent)} probes passed"
        + (f" ({skipped})" if skipped else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0
