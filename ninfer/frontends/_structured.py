"""Structured outputs: a JSON schema made into the grammar the engine decodes under.

The grammar engine is llguidance (see docs/benchmarks-history.md for why); it compiles a JSON
schema into a grammar lazily, so compiling per request costs about a millisecond. The
output is compact JSON (no free whitespace between tokens: a model, however weak,
cannot spend its budget on blanks) that matches the schema by construction, unless the
token budget ends it first (`finish_reason: length`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import llguidance
import orjson

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from protocols import ApiError

__all__ = [
    "ANY_JSON_OBJECT",
    "UNENFORCEABLE",
    "closed_objects",
    "json_schema_grammar",
    "rebased",
    "think_first",
]

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # OpenAI's json_object
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}
UNENFORCEABLE = "the schema is not a JSON Schema that can be enforced while decoding"
_KEYWORD = re.compile(r"^[A-Za-z$][A-Za-z0-9_$]{0,40}$")


def json_schema_grammar(schema: dict[str, Any], *, param: str, think: bool = False) -> str:
    """The llguidance grammar of `schema` (`think`: after a reasoning block,
    `think_first`); a refusal naming `param` (and the JSON Schema keywords it does not
    implement, when that is why) for one it cannot enforce."""
    schema = closed_objects(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise ApiError("invalid_request", _reason(error), param=param, code="invalid_value")
    if think:
        body = orjson.dumps({**schema, "x-guidance": _COMPACT}).decode()
        return think_first("%llguidance {}\nstart: %json " + body)
    return str(grammar)


# ---- closed objects ----------------------------------------------------------------
#
# JSON Schema leaves an object open: without `additionalProperties`, any key beyond
# `properties` validates, and a small model fills that room with keys nobody asked for
# (SmolLM2: 7 of 15 answers). Like llama.cpp's converter (and OpenAI's strict mode), the
# grammar generates only the declared properties unless the schema opens the object
# (`additionalProperties: true` or a schema for them). Every document generated still
# validates against the client's schema: it is a subset of what the schema accepts.
#
# An object is closed only where closing it changes nothing but the extra keys: not
# where the schema combines it with another (a member of `allOf`, of an `anyOf`/`oneOf`
# beside sibling keywords, a `$ref` target used so, or one that itself carries such
# keywords), whose keys JSON Schema counts separately for each part.

_COMBINING = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not",
              "dependentSchemas", "unevaluatedProperties")  # fmt: skip
# Keywords that say nothing about which documents validate.
_ANNOTATIONS = frozenset(("title", "description", "$comment", "examples", "default",
                          "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                          "$schema", "$id", "$anchor", "x-guidance"))  # fmt: skip
# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties",
        "additionalItems")  # fmt: skip
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _children(node: dict[str, Any], pointer: str) -> Iterator[tuple[str, str, Any, Any]]:
    """(keyword, pointer, key, subschema) for each subschema directly under `node`
    (key: the property name or list index, None for a single schema)."""
    for kw in _ONE:
        if kw in node and not isinstance(node[kw], list):  # (a list of items: below)
            yield kw, f"{pointer}/{kw}", None, node[kw]
    for kw in _MANY:
        if isinstance(node.get(kw), list):
            for i, sub in enumerate(node[kw]):
                yield kw, f"{pointer}/{kw}/{i}", i, sub
    if isinstance(node.get("items"), list):  # draft 4's tuple form
        for i, sub in enumerate(node["items"]):
            yield "items", f"{pointer}/items/{i}", i, sub
    for kw in _NAMED:
        if isinstance(node.get(kw), dict):
            for name, sub in node[kw].items():
                yield kw, f"{pointer}/{kw}/{_escape(str(name))}", name, sub


def _put(copy: dict[str, Any], node: dict[str, Any], kw: str, key: Any, sub: Any) -> None:
    """Set a subschema in `copy`, a shallow copy of `node` (`kw`, `key` as `_children`
    gives them), copying the list or map that holds it once (an anyOf of thousands)."""
    if key is None:
        copy[kw] = sub
        return
    if copy[kw] is node[kw]:
        copy[kw] = list(node[kw]) if isinstance(node[kw], list) else dict(node[kw])
    copy[kw][key] = sub


def _combined(node: dict[str, Any], but: str) -> bool:
    """`node` constrains the document with keywords beside `but` (and annotations)."""
    return any(k not in _ANNOTATIONS and k != but for k in node)


def _merged_pointers(root: Any) -> set[str]:
    """The pointers of the subschemas whose object is validated together with another
    schema's (see above), and of every `$ref` target used in such a place."""
    merged: set[str] = set()

    def walk(node: Any, pointer: str) -> None:
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and (_combined(node, "$ref") or pointer in merged):
            merged.add(unquote(ref))
        for kw, sub_pointer, _, sub in _children(node, pointer):
            if kw in ("allOf", "anyOf", "oneOf"):
                alone = kw == "allOf" and len(node[kw]) == 1  # pydantic v1's `$ref` wrapper
                if (kw == "allOf" and not alone) or _combined(node, kw):
                    merged.add(sub_pointer)
            walk(sub, sub_pointer)

    size = -1
    while size != len(merged):  # until a `$ref` chain's targets are all found
        size = len(merged)
        walk(root, "#")
    return merged


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each object that declares `properties` and says nothing of
    `additionalProperties` closed (`additionalProperties: false`), where that narrows
    only the extra keys (see above). The client's schema is not changed."""
    merged = _merged_pointers(schema)

    def close(node: Any, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] | None = None  # a copy, once something under it changes
        for kw, sub_pointer, key, sub in _children(node, pointer):
            new = close(sub, sub_pointer)
            if new is sub:
                continue
            out = dict(node) if out is None else out
            _put(out, node, kw, key, new)
        if (
            isinstance(node.get("properties"), dict)
            and "additionalProperties" not in node
            and not any(k in node for k in _COMBINING)
            and pointer not in merged
        ):
            out = dict(node) if out is None else out
            out["additionalProperties"] = False
        return node if out is None else out

    result: dict[str, Any] = close(schema, "#")
    return result


def rebased(schema: dict[str, Any], at: str) -> dict[str, Any]:
    """`schema` to be placed at the JSON pointer `at` of a larger schema: each local
    `$ref` ("#", "#/$defs/X") made to point where its target then is."""

    def move(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = at + ref[1:]
        for kw, _, key, sub in _children(node, "#"):
            _put(out, node, kw, key, move(sub))
        return out

    result: dict[str, Any] = move(schema)
    return result


# The reasoning: any text up to the first </think> (which ends it), then blank lines.
_THINK = "THINK: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.*)<\\/think>(?s:.*)/\n"
_BLANK = "BLANK: /[ \\n]+/\n"


def think_first(grammar: str) -> str:
    """A Lark grammar (llguidance's, with one `start` rule) made to begin with a
    reasoning block: an optional `<think>` (the prompt may have opened it), free text up
    to the first `</think>`, optional blank lines, then what `grammar` allows."""
    lines = grammar.split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("start:")]
    assert len(starts) == 1, "a grammar with one start rule"
    lines[starts[0]] = "answer:" + lines[starts[0]][len("start:") :]
    lines.insert(starts[0], 'start: "<think>"? THINK BLANK? answer')
    return "\n".join(lines) + "\n" + _THINK + _BLANK


def _reason(error: str) -> str:
    """What is wrong, in words that carry none of the client's text but the names of
    JSON Schema keywords."""
    if error.startswith("Unimplemented keys:"):
        try:
            names = orjson.loads(error.split(":", 1)[1].strip())
        except orjson.JSONDecodeError:
            names = []
        keywords = [n for n in names if isinstance(n, str) and _KEYWORD.match(n)]
        if keywords:
            listed = ", ".join(keywords)
            return f"the schema uses JSON Schema keywords that cannot be enforced: {listed}"
    return UNENFORCEABLE
