"""The OpenAPI 3.1 document of ninfer's HTTP contract, generated from the protocol classes.

`docs/openapi.json` is this document, committed; a test regenerates it and classifies
any difference (protocols._compat) so that an incompatible change cannot land unnoticed.
Streams are described with their events' schemas under `x-stream-events` (named SSE
events) or `x-stream-data` (OpenAI's data-only lines), since OpenAPI has no SSE model.
"""

from __future__ import annotations

from typing import Any

from protocols._answers import (
    ANTHROPIC_STREAM_EVENTS,
    NATIVE_STREAM_EVENTS,
    RESPONSES_STREAM_EVENTS,
    AnthropicErrorBody,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CountTokensResponse,
    GenerateResponse,
    InputItemList,
    InputTokensCount,
    MessageResponse,
    ModelCard,
    ModelList,
    NativeErrorBody,
    OpenAIErrorBody,
    ResponseDeleted,
    ResponseObject,
)
from protocols._anthropic import CountTokensRequest, MessagesRequest
from protocols._embeddings import (
    EmbeddingList,
    EmbeddingRequest,
    LlamaEmbedding,
    LlamaEmbeddingRequest,
)
from protocols._llama import AppliedTemplate, LlamaCompletion, LlamaCompletionRequest
from protocols._native import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from protocols._openai import ChatRequest, CompletionRequest
from protocols._responses_api import InputTokensRequest, ResponsesRequest
from protocols._schema import Schemas

__all__ = ["openapi_document"]

_NATIVE_STATUSES = ("400", "401", "404", "405", "408", "413", "415", "422", "429", "503")
_COMPAT_STATUSES = ("400", "401", "404", "405", "408", "413", "415", "429", "503")


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _errors(ref: dict[str, Any], statuses: tuple[str, ...], rid: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in statuses:
        headers: dict[str, Any] = {rid: {"schema": {"type": "string"}}}
        if status in ("429", "503"):
            headers["Retry-After"] = {"schema": {"type": "integer", "minimum": 1}}
            headers["retry-after-ms"] = {
                "description": "the same estimate in milliseconds (see docs/scheduler.md)",
                "schema": {"type": "integer", "minimum": 1},
            }
        if status == "429":
            headers["ninfer-retry-token"] = {
                "description": "the promise of a place held for this client, when one is: "
                "a retry that sends it back as the request header ninfer-retry-token "
                "claims that place (docs/scheduler.md)",
                "schema": {"type": "string"},
            }
        out[status] = {
            "description": "refused; see docs/errors.md",
            "headers": headers,
            "content": _json(ref),
        }
    return out


def _responses_paths(s: Schemas, generation: Any, openai_err: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI Responses core: creation (a body or semantic events), the local store's
    routes, and the token count."""
    rid = {"X-Request-Id": {"schema": {"type": "string"}}}
    response_id = [{"name": "response_id", "in": "path", "required": True,
                    "schema": {"type": "string"}}]  # fmt: skip

    def answer(cls: type, what: str) -> dict[str, Any]:
        return {"description": what, "headers": rid,
                "content": _json(s.ref(cls, request=False))}  # fmt: skip

    stored_errors = _errors(openai_err, ("401", "404", "503"), "X-Request-Id")
    refused = _errors(openai_err, ("400", "401", "503"), "X-Request-Id")
    return {
        "/v1/responses": generation(
            "OpenAI Responses (core): typed Items in, a Response or semantic SSE events out",
            s.ref(ResponsesRequest, request=True, nullable=True),
            s.ref(ResponseObject, request=False),
            {"x-stream-events": {k: s.ref(v, request=False)
                                 for k, v in RESPONSES_STREAM_EVENTS.items()}},
            _errors(openai_err, _COMPAT_STATUSES, "X-Request-Id"),
        ),
        "/v1/responses/input_tokens": {
            "post": {
                "summary": "count the input tokens /v1/responses would build",
                "requestBody": {"required": True, "content": _json(
                    s.ref(InputTokensRequest, request=True, nullable=True))},
                "responses": {"200": answer(InputTokensCount, "counted"),
                              **_errors(openai_err, _COMPAT_STATUSES, "X-Request-Id")},
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "a stored Response (this process only; see docs/api.md)",
                "parameters": response_id,
                "responses": {"200": answer(ResponseObject, "the stored Response"),
                              **stored_errors},
            },
            "delete": {
                "summary": "delete a stored Response",
                "parameters": response_id,
                "responses": {"200": answer(ResponseDeleted, "deleted"), **stored_errors},
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "the input Items of a stored Response",
                "parameters": [
                    *response_id,
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
                    {"name": "order", "in": "query",
                     "schema": {"enum": ["asc", "desc"], "default": "desc"}},
                ],
                "responses": {"200": answer(InputItemList, "one page of Items"),
                              **_errors(openai_err, ("400", "401", "404", "503"),
                                        "X-Request-Id")},
            }
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "always refused: nothing runs in the background here",
                "parameters": response_id,
                "responses": refused,
            }
        },
        "/v1/responses/compact": {
            "post": {"summary": "always refused: compaction is not supported",
                     "responses": refused},
        },
    }  # fmt: skip


def openapi_document(version: str) -> dict[str, Any]:
    s = Schemas()

    def req(cls: type, nullable: bool) -> dict[str, Any]:
        return s.ref(cls, request=True, nullable=nullable)

    def resp(cls: type) -> dict[str, Any]:
        return s.ref(cls, request=False)

    native_err = resp(NativeErrorBody)
    openai_err = resp(OpenAIErrorBody)
    anthropic_err = resp(AnthropicErrorBody)
    rid = {"X-Request-Id": {"schema": {"type": "string"}}}

    def generation(
        summary: str,
        body: dict[str, Any],
        ok: dict[str, Any],
        stream: dict[str, Any],
        errors: dict[str, Any],
        rid_name: str = "X-Request-Id",
    ) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": _json(body)},
                "responses": {
                    "200": {
                        "description": "generated",
                        "headers": {rid_name: {"schema": {"type": "string"}}},
                        "content": {
                            **_json(ok),
                            "text/event-stream": {"schema": {"type": "string"}, **stream},
                        },
                    },
                    **errors,
                },
            }
        }

    def embedding(
        summary: str, body: dict[str, Any], ok: dict[str, Any], errors: dict[str, Any]
    ) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {"200": {"description": "the inputs' vectors, in order",
                                  "headers": rid, "content": _json(ok)},
                          **errors},
        }}  # fmt: skip

    def tokenizing(summary: str, request: type, answer: type, what: str) -> dict[str, Any]:
        """A native POST route that answers one JSON object (/tokenize, /detokenize)."""
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(req(request, False))},
            "responses": {"200": {"description": what, "headers": rid,
                                  "content": _json(resp(answer))},
                          **_errors(native_err, _NATIVE_STATUSES, "X-Request-Id")},
        }}  # fmt: skip

    def health(summary: str) -> dict[str, Any]:
        return {"get": {
            "summary": summary,
            "responses": {
                "200": {"description": "up", "content": _json(
                    {"type": "object", "properties": {"status": {"const": "ok"}},
                     "required": ["status"]})},
                **_errors(native_err, ("503",), "X-Request-Id"),
            },
        }}  # fmt: skip

    paths: dict[str, Any] = {
        "/health": health("liveness (503 once the engine has failed to load or died)"),
        "/v1/health": health("/health under llama-server's name"),
        "/ready": {
            "get": {
                "summary": "readiness (503 while loading, draining or failed)",
                "responses": {
                    "200": {"description": "serving", "content": _json(
                        {"type": "object", "required": ["status", "model"],
                         "properties": {"status": {"const": "ready"}, "model": {
                             "type": "object", "required": ["id", "architecture", "sha256"],
                             "properties": {"id": {"type": "string"},
                                            "architecture": {"type": "string"},
                                            "sha256": {"type": "string"}}},
                         "request_log": {
                             "type": "object", "required": ["ok", "dropped"],
                             "description": "whether --request-log-jsonl is being written; "
                             "records dropped since start-up",
                             "properties": {"ok": {"type": "boolean"},
                                            "dropped": {"type": "integer", "minimum": 0},
                                            "error": {"type": "string"}}},
                         "self_check": {
                             "type": "object", "required": ["passed", "refused"],
                             "description": "the fast paths checked against float64 at "
                             "start-up: those in use, and those refused with what runs instead",
                             "properties": {
                                 "passed": {"type": "array", "items": {"type": "string"}},
                                 "refused": {"type": "array", "items": {
                                     "type": "object", "required": ["path", "instead"],
                                     "properties": {"path": {"type": "string"},
                                                    "instead": {"type": "string"}}}}}}}})},
                    **_errors(native_err, ("503",), "X-Request-Id"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (docs/metrics.md)",
                "responses": {
                    "200": {"description": "text format 0.0.4",
                            "content": {"text/plain": {"schema": {"type": "string"}}}},
                    **_errors(native_err, ("401",), "X-Request-Id"),
                },
            }
        },
        "/version": {
            "get": {
                "summary": "ninfer's version (as vLLM's), torch's, the request log's schema",
                "responses": {
                    "200": {"description": "versions", "content": _json(
                        {"type": "object",
                         "required": ["version", "torch", "request_log_schema"],
                         "properties": {"version": {"type": "string"},
                                        "torch": {"type": "string"},
                                        "request_log_schema": {"type": "integer"}}})},
                    **_errors(native_err, ("401",), "X-Request-Id"),
                },
            }
        },
        "/props": {
            "get": {
                "summary": "the model, its context, template and capabilities (as llama.cpp's)",
                "responses": {
                    "200": {"description": "properties", "content": _json(
                        {"type": "object",
                         "required": ["model", "served_names", "architecture", "n_ctx",
                                      "total_slots", "chat_template", "capabilities",
                                      "modalities", "default_generation_settings",
                                      "build_info"],
                         "properties": {
                             "model": {"type": "string"},
                             "served_names": {"type": "array", "items": {"type": "string"}},
                             "architecture": {"type": "string"},
                             "n_ctx": {"type": "integer"},
                             "total_slots": {"type": "integer"},
                             "chat_template": {"type": ["string", "null"]},
                             "capabilities": {"type": "object", "additionalProperties": {
                                 "type": "boolean"}},
                             "modalities": {"type": "object", "additionalProperties": {
                                 "type": "boolean"}},
                             "default_generation_settings": {"type": "object"},
                             "build_info": {"type": "string"}}})},
                    **_errors(native_err, ("401", "503"), "X-Request-Id"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document: the contract the server keeps",
                "responses": {
                    "200": {"description": "OpenAPI 3.1", "content": _json({"type": "object"})},
                    **_errors(native_err, ("401",), "X-Request-Id"),
                },
            }
        },
        "/v1/generate": generation(
            "native generation",
            req(GenerateRequest, False),
            resp(GenerateResponse),
            {"x-stream-events": {k: resp(v) for k, v in NATIVE_STREAM_EVENTS.items()}},
            _errors(native_err, _NATIVE_STATUSES, "X-Request-Id"),
        ),
        "/v1/chat/completions": generation(
            "OpenAI-compatible chat completion",
            req(ChatRequest, True),
            resp(ChatCompletion),
            {"x-stream-data": {"anyOf": [resp(ChatCompletionChunk), openai_err]},
             "x-stream-end": "data: [DONE]"},
            _errors(openai_err, _COMPAT_STATUSES, "X-Request-Id"),
        ),
        "/v1/completions": generation(
            "OpenAI-compatible text completion",
            req(CompletionRequest, True),
            resp(Completion),
            {"x-stream-data": {"anyOf": [resp(CompletionChunk), openai_err]},
             "x-stream-end": "data: [DONE]"},
            _errors(openai_err, _COMPAT_STATUSES, "X-Request-Id"),
        ),
        "/v1/models": {
            "get": {
                "summary": "the served model (OpenAI-compatible)",
                "responses": {"200": {"description": "one model", "headers": rid,
                                      "content": _json(resp(ModelList))},
                              **_errors(openai_err, ("401", "503"), "X-Request-Id")},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "one model card (OpenAI-compatible)",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "headers": rid,
                                      "content": _json(resp(ModelCard))},
                              **_errors(openai_err, ("401", "404", "503"), "X-Request-Id")},
            }
        },
        "/v1/messages": generation(
            "Anthropic-compatible messages",
            req(MessagesRequest, True),
            resp(MessageResponse),
            {"x-stream-events": {k: resp(v) for k, v in ANTHROPIC_STREAM_EVENTS.items()}},
            _errors(anthropic_err, _COMPAT_STATUSES, "Request-Id"),
            rid_name="Request-Id",
        ),
        "/completion": generation(
            "llama-server's completion: a raw prompt, its answer's shape",
            req(LlamaCompletionRequest, False),
            resp(LlamaCompletion),
            {"x-stream-data": {"anyOf": [resp(LlamaCompletion), native_err]},
             "x-stream-end": "the event with stop: true"},
            _errors(native_err, _NATIVE_STATUSES, "X-Request-Id"),
        ),
        "/v1/embeddings": embedding(
            "OpenAI-compatible embeddings: a vector an input (docs/api.md, Embeddings)",
            req(EmbeddingRequest, True),
            resp(EmbeddingList),
            _errors(openai_err, _COMPAT_STATUSES, "X-Request-Id"),
        ),
        **{
            path: embedding(
                "llama-server's embeddings: a JSON array of {index, embedding} (rows)",
                req(LlamaEmbeddingRequest, False),
                {"type": "array", "items": resp(LlamaEmbedding)},
                _errors(native_err, _NATIVE_STATUSES, "X-Request-Id"),
            )
            for path in ("/embedding", "/embeddings")
        },
        "/apply-template": {
            "post": {
                "summary": "a chat rendered to the prompt /v1/chat/completions would use "
                "(llama-server's)",
                "requestBody": {"required": True, "content": _json(req(ChatRequest, True))},
                "responses": {"200": {"description": "the prompt", "headers": rid,
                                      "content": _json(resp(AppliedTemplate))},
                              **_errors(openai_err, _COMPAT_STATUSES, "X-Request-Id")},
            }
        },
        "/slots": {
            "get": {
                "summary": "llama-server's slots, read-only: one a --max-concurrency place, "
                "the running requests in the first",
                "parameters": [{"name": "fail_on_no_slot", "in": "query",
                                "schema": {"enum": ["0", "1"]}}],
                "responses": {"200": {"description": "the slots", "content": _json(
                    {"type": "array", "items": {
                        "type": "object",
                        "required": ["id", "n_ctx", "speculative", "is_processing"],
                        "properties": {"id": {"type": "integer"}, "n_ctx": {"type": "integer"},
                                       "speculative": {"type": "boolean"},
                                       "is_processing": {"type": "boolean"},
                                       "request_id": {"type": "string"},
                                       "endpoint": {"type": "string"},
                                       "stage": {"enum": ["prefill", "decode"]}}}})},
                              **_errors(native_err, ("401", "429", "503"), "X-Request-Id")},
            }
        },
        "/v1/stream": {
            "get": {
                "summary": "llama-server's resumable stream: a generation's SSE bytes from an "
                "offset, then its live ones to its end (docs/api.md, Resumable streams)",
                "parameters": [{"name": "conv_id", "in": "query", "required": True,
                                "schema": {"type": "string"}},
                               {"name": "from", "in": "query",
                                "schema": {"type": "integer", "minimum": 0}}],
                "responses": {"200": {"description": "the stream's bytes, as first sent",
                                      "content": {"text/event-stream": {
                                          "schema": {"type": "string"}}}},
                              **_errors(openai_err, ("400", "401", "404", "503"),
                                        "X-Request-Id")},
            },
            "delete": {
                "summary": "stop a conversation's generation and drop its stream (llama-server's)",
                "parameters": [{"name": "conv_id", "in": "query", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"204": {"description": "stopped, or there was none"},
                              **_errors(openai_err, ("400", "401", "404", "503"),
                                        "X-Request-Id")},
            },
        },
        "/v1/streams/lookup": {
            "post": {
                "summary": "the resumable streams of the named conversations (llama-server's)",
                "requestBody": {"required": True, "content": _json(
                    {"type": "object", "properties": {"conversation_ids": {
                        "type": "array", "items": {"type": "string"}}}})},
                "responses": {"200": {"description": "one entry a stream", "content": _json(
                    {"type": "array", "items": {
                        "type": "object",
                        "required": ["conversation_id", "is_done", "total_bytes",
                                     "started_at", "completed_at"],
                        "properties": {"conversation_id": {"type": "string"},
                                       "is_done": {"type": "boolean"},
                                       "total_bytes": {"type": "integer"},
                                       "started_at": {"type": "integer"},
                                       "completed_at": {"type": "integer"}}}})},
                              **_errors(openai_err, ("400", "401", "404", "503"),
                                        "X-Request-Id")},
            }
        },
        "/tools": {
            method: {
                "summary": "llama-server's built-in tools: not run here (403 feature_disabled, "
                "as llama-server answers when started without them)",
                "responses": _errors(openai_err, ("401", "403"), "X-Request-Id"),
            }
            for method in ("get", "post")
        },
        "/tokenize": tokenizing(
            "a text's tokens (llama.cpp's and vLLM's shapes, one answer)",
            TokenizeRequest, TokenizeResponse, "tokenized"),
        "/detokenize": tokenizing(
            "tokens' text (llama.cpp's content and vLLM's prompt)",
            DetokenizeRequest, DetokenizeResponse, "text"),
        "/v1/messages/count_tokens": {
            "post": {
                "summary": "count a conversation's tokens (Anthropic-compatible)",
                "requestBody": {"required": True,
                                "content": _json(req(CountTokensRequest, True))},
                "responses": {"200": {"description": "counted",
                                      "headers": {"Request-Id": {"schema": {"type": "string"}}},
                                      "content": _json(resp(CountTokensResponse))},
                              **_errors(anthropic_err, _COMPAT_STATUSES, "Request-Id")},
            }
        },
    }  # fmt: skip
    paths.update(_responses_paths(s, generation, openai_err))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ninfer",
            "version": version,
            "description": "An LLM inference server that admits what it can serve and "
            "refuses the rest at once. Errors: docs/errors.md; fields: docs/api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": dict(sorted(s.components.items())),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
