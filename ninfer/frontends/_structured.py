"""Structured outputs: a JSON schema made into the grammar the engine decodes under.

The grammar engine is llguidance (see docs/benchmarks-history.md for why); it compiles a JSON
schema into a grammar lazily, so compiling per request costs about a millisecond. The
output is compact JSON (no free whitespace between tokens: a model, however weak,
cannot spend its budget on blanks) that matches the schema by construction, unless the
token budget ends it first (`finish_reason: length`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import llguidance
import orjson

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from protocols import ApiError

__all__ = ["ANY_JSON_OBJECT", "UNENFORCEABLE", "json_schema_grammar"]

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # OpenAI's json_object
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}
UNENFORCEABLE = "the schema is not a JSON Schema that can be enforced while decoding"
_KEYWORD = re.compile(r"^[A-Za-z$][A-Za-z0-9_$]{0,40}$")


def json_schema_grammar(schema: dict[str, Any], *, param: str) -> str:
    """The llguidance grammar of `schema`; a refusal naming `param` (and the JSON Schema
    keywords it does not implement, when that is why) for one it cannot enforce."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise ApiError("invalid_request", _reason(error), param=param, code="invalid_value")
    return str(grammar)


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
