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

__all__ = ["ANY_JSON_OBJECT", "UNENFORCEABLE", "json_schema_grammar", "think_first"]

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}  # OpenAI's json_object
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}
UNENFORCEABLE = "the schema is not a JSON Schema that can be enforced while decoding"
_KEYWORD = re.compile(r"^[A-Za-z$][A-Za-z0-9_$]{0,40}$")


def json_schema_grammar(schema: dict[str, Any], *, param: str, think: bool = False) -> str:
    """The llguidance grammar of `schema` (`think`: after a reasoning block,
    `think_first`); a refusal naming `param` (and the JSON Schema keywords it does not
    implement, when that is why) for one it cannot enforce."""
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
