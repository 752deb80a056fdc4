"""The OpenAPI document as a test oracle: strict response validators, and Hypothesis
strategies for request bodies the schemas accept.

The strategies cover the subset of JSON Schema the generator emits (type, properties,
required, additionalProperties, items, anyOf, enum/const, numeric and length limits).
hypothesis-jsonschema would do this in general, but its last release does not run on
current Hypothesis.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import jsonschema
import orjson
from hypothesis import strategies as st

from ninfer import __version__
from protocols import openapi_document

DOC: dict[str, Any] = openapi_document(__version__)
COMPONENTS: dict[str, Any] = DOC["components"]["schemas"]


def _strict(schema: Any) -> Any:
    """Response schemas as the tests read them: no field beyond those documented."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


_STRICT_COMPONENTS = _strict(COMPONENTS)


def validator(ref: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A strict validator for `{"$ref": "#/components/schemas/X"}` (or any schema)."""
    root = {"components": {"schemas": _STRICT_COMPONENTS}, **_strict(ref)}
    return jsonschema.Draft202012Validator(root)


def operation(path: str, method: str = "post") -> dict[str, Any]:
    op: dict[str, Any] = DOC["paths"][path][method]
    return op


def response_validator(path: str, status: int, method: str = "post") -> Any:
    responses = operation(path, method)["responses"]
    media = responses[str(status)]["content"]["application/json"]
    return validator(media["schema"])


def stream_validators(path: str) -> tuple[dict[str, Any] | None, Any | None]:
    """(named event -> validator) or (a validator for data lines)."""
    media = operation(path)["responses"]["200"]["content"]["text/event-stream"]
    if "x-stream-events" in media:
        return {k: validator(v) for k, v in media["x-stream-events"].items()}, None
    return None, validator(media["x-stream-data"])


def inline(schema: Any) -> Any:
    """The schema with every `$ref` replaced by its component (request schemas have no
    cycles)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return inline(COMPONENTS[schema["$ref"].rsplit("/", 1)[-1]])
        return {k: inline(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [inline(v) for v in schema]
    return schema


def request_schema(path: str) -> dict[str, Any]:
    body = operation(path)["requestBody"]["content"]["application/json"]["schema"]
    return copy.deepcopy(inline(body))


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema accepts."""
    if "anyOf" in schema:
        return st.one_of([from_schema({**b, **_shared(schema)}) for b in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = schema.get("minimum", -(2**31))
        hi = schema.get("maximum", 2**31)
        return st.integers(lo, hi)
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1e6))
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 1e6))
        return st.floats(
            lo,
            hi,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
        )
    if kind == "string":
        return st.text(
            alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
            min_size=schema.get("minLength", 0),
            max_size=min(schema.get("maxLength", 24), 24),
        )
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {})),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", 3), 3),
        )
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        props = schema["properties"]
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    if kind == "object":
        return st.dictionaries(st.sampled_from(["a", "b", "type"]), _TEXT, max_size=2)
    return st.one_of(st.none(), st.booleans(), st.integers(), _TEXT)


def _shared(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "anyOf"}


def check_answer(path: str, r: httpx.Response, body: dict[str, Any]) -> str:
    """What a route's answer is ("refused", "streamed", "answered"), asserting it is no
    5xx and that it validates against the documented schema (an error: against the
    route's error envelope; a stream: each event)."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        envelope = {
            "/v1/generate": "NativeErrorBody",
        }.get(path, "AnthropicErrorBody" if "/messages" in path else "OpenAIErrorBody")
        validator({"$ref": f"#/components/schemas/{envelope}"}).validate(r.json())
        return "refused"
    if r.headers["content-type"].startswith("text/event-stream"):
        _check_stream(path, r.text)
        return "streamed"
    response_validator(path, 200).validate(r.json())
    return "answered"


def _check_stream(path: str, text: str) -> None:
    events, data = stream_validators(path)
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" not in lines:
            continue
        if events is not None:
            events[lines["event"]].validate(orjson.loads(lines["data"]))
        elif lines["data"] != "[DONE]":
            assert data is not None
            data.validate(orjson.loads(lines["data"]))
