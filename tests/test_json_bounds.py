"""What the grammar of a JSON answer narrows beyond JSON Schema: numbers whose runs of
digits are capped, and objects closed to undeclared keys. Both narrow the answers to a
subset of those the client's schema accepts, so each test also checks that what the
schema itself needs (a `minimum` of 10^17, a digit-only pattern, an open object) is
still reachable. Model-free: a Constraint driven token by token over the tiny model's
byte-level vocabulary, by a "model" that always wants one more digit or one more key."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ninfer.engine._gguf import open_gguf
from ninfer.engine._grammar import (
    EXPONENT_DIGITS,
    NUMBER_DIGITS,
    Constraint,
    GrammarVocabulary,
    TokenDigits,
    grammar_tokenizer,
)
from ninfer.engine._tokenizer import tokenizer_from_metadata
from ninfer.frontends._structured import closed_objects, json_schema_grammar
from ninfer.frontends._tools import Tool, ToolPlan, tool_grammar


class Driver:
    """A constrained row without a model: feed text, or let a fixed preference choose."""

    def __init__(self, vocab: GrammarVocabulary, lltok: Any, n_vocab: int, grammar: str) -> None:
        self.vocab = vocab
        digits = TokenDigits(vocab, n_vocab)
        self.c = Constraint(Constraint.compile(lltok, grammar), n_vocab, digits)
        self.text = b""

    def allows(self, text: str) -> bool:
        """Whether the next token may be `text`'s (one token)."""
        (token,) = self.vocab(text)
        return bool(self.c.allowed()[token])

    def feed(self, text: str) -> None:
        for token in self.vocab(text):
            assert self.c.allowed()[token], (self.text, text)
            self.take(token)

    def take(self, token: int) -> None:
        self.c.advance(token)
        if token not in self.vocab.special_token_ids:
            self.text += self.vocab.tokens[token]

    def run(self, prefer: Sequence[str], steps: int = 400) -> str:
        """Greedy on a fixed preference (the first allowed of `prefer`'s one-token
        texts, else the allowed token of lowest id) until the grammar is done."""
        wanted = [self.vocab(t)[0] for t in prefer]
        for _ in range(steps):
            if self.c.done:
                return self.text.decode()
            allowed = self.c.allowed()
            assert bool(allowed.any()), self.text
            token = next((t for t in wanted if allowed[t]), None)
            if token is None:
                token = int(allowed.nonzero()[0])
            self.take(token)
        raise AssertionError(f"never finished: {self.text[:120]!r}")


@pytest.fixture(scope="module")
def tables(tiny_gguf: Path) -> tuple[GrammarVocabulary, Any, int]:
    tok = tokenizer_from_metadata(open_gguf(tiny_gguf).metadata)
    vocab = GrammarVocabulary.of(tok)
    return vocab, grammar_tokenizer(vocab, tok.vocab_size), tok.vocab_size


def driver(tables: tuple[GrammarVocabulary, Any, int], schema: dict[str, Any]) -> Driver:
    return Driver(*tables, json_schema_grammar(schema, param="schema"))


DIGIT_FIRST = ["7", ".", "e", "+", "}"]  # a model that always wants more digits


def test_a_number_cannot_run_on(tables: tuple[GrammarVocabulary, Any, int]) -> None:
    """The integer part, the fraction and the exponent each stop at their cap, where a
    model that always wants another digit is made to go on (no 40-digit integer); the
    document still parses and validates."""
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}
    d = driver(tables, schema)
    d.feed('{"n":' + "1" * NUMBER_DIGITS)
    assert not d.allows("1")  # a 16th digit
    assert d.allows(".")
    assert d.allows("e")
    assert d.allows("}")
    text = d.run(DIGIT_FIRST)
    int_part, rest = text[len('{"n":') :].split(".")
    fraction, exponent = rest.split("e")
    assert int_part == "1" * NUMBER_DIGITS
    assert fraction == "7" * NUMBER_DIGITS
    assert exponent == "7" * EXPONENT_DIGITS + "}"
    assert isinstance(json.loads(text)["n"], float)
    d = driver(tables, schema)
    d.feed('{"n":1e-')
    assert d.run(DIGIT_FIRST) == '{"n":1e-' + "7" * EXPONENT_DIGITS + "}"


def test_an_integer_and_any_json_are_capped(tables: tuple[GrammarVocabulary, Any, int]) -> None:
    """An integer (a negative one too), a number inside an array, and the values of
    `json_object`'s open object all stop at the cap."""
    d = driver(tables, {"type": "integer"})
    d.feed("-")
    assert d.run(DIGIT_FIRST) == "-" + "7" * NUMBER_DIGITS
    d = driver(tables, {"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    assert d.run([*DIGIT_FIRST, ",", "]"]) == "[" + ",".join(["7" * NUMBER_DIGITS] * 2) + "]"
    d = driver(tables, {"type": "object"})
    d.feed('{"a":[')
    assert d.run([*DIGIT_FIRST, "]"]).startswith('{"a":[' + "7" * NUMBER_DIGITS + ".")


def test_what_the_schema_needs_is_not_capped(tables: tuple[GrammarVocabulary, Any, int]) -> None:
    """The cap gives way where the grammar allows nothing but a digit: an integer whose
    `minimum` needs 18 digits (the largest bound llguidance compiles) gets them, as does a
    number between bounds 10^-16 apart and a string pattern of 20 digits; digits inside a
    string are never capped."""
    d = driver(tables, {"type": "integer", "minimum": 10**17})
    text = d.run(["1", "0", "}"])
    assert len(text) == 18
    assert int(text) >= 10**17
    d = driver(tables, {"type": "number", "minimum": 0.1234567890123456,
                        "maximum": 0.1234567890123457})  # fmt: skip
    d.feed("0.123456789012345")
    assert d.allows("6")  # the 16th decimal is needed
    d.feed("6")
    assert not d.allows("6")
    d = driver(tables, {"type": "string", "pattern": "^[0-9]{20}$"})
    assert d.run(["7", '"']) == '"' + "7" * 20 + '"'
    d = driver(tables, {"type": "string", "maxLength": 40})
    assert d.run(["7", '"']) == '"' + "7" * 40 + '"'


def test_objects_are_closed_unless_opened(tables: tuple[GrammarVocabulary, Any, int]) -> None:
    """A schema without `additionalProperties` gets only its declared keys (the
    openai SDK's and pydantic's plain schemas, nested through `$defs` too);
    `additionalProperties: true` or a schema for them opens the object again, and an
    object that declares no properties stays any object."""
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    d = driver(tables, city)
    d.feed('{"name":"x"')
    assert not d.allows(",")
    assert d.allows("}")
    nested = {"type": "object", "properties": {"c": {"$ref": "#/$defs/City"}},
              "required": ["c"], "$defs": {"City": city}}  # fmt: skip
    d = driver(tables, nested)
    d.feed('{"c":{"name":"x"')
    assert not d.allows(",")
    d.feed("}")
    assert not d.allows(",")
    for opened in (True, {"type": "integer"}):
        d = driver(tables, {**city, "additionalProperties": opened})
        d.feed('{"name":"x"')
        assert d.allows(",")
    d = driver(tables, {"type": "object"})
    d.feed('{"anything":1')
    assert d.allows(",")


def test_combined_objects_are_left_as_json_schema_reads_them(
    tables: tuple[GrammarVocabulary, Any, int],
) -> None:
    """An object validated together with another (`allOf`'s members, an `anyOf` beside
    sibling keywords, a `$ref` merged with siblings) is not closed: closing one part
    would forbid the keys the other part declares."""
    a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    # (llguidance writes merged properties in the order the parts declare them.)
    b_first = {k: v for k, v in b.items() if k != "type"}
    schemas: list[tuple[dict[str, Any], str]] = [
        ({"allOf": [a, b]}, '{"a":1,"b":2}'),
        ({"allOf": [{"$ref": "#/$defs/A"}, b], "$defs": {"A": a}}, '{"a":1,"b":2}'),
        ({**b_first, "anyOf": [a]}, '{"b":2,"a":1}'),
        ({**b_first, "$ref": "#/$defs/A", "$defs": {"A": a}}, '{"b":2,"a":1}'),
    ]
    for schema, document in schemas:
        d = driver(tables, schema)
        d.feed(document)
        assert d.c.done or d.allows("}"), schema
    # pydantic v1's one-member wrapper is no combination: its target is closed.
    assert (
        closed_objects({"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": a}})["$defs"]["A"][
            "additionalProperties"
        ]
        is False
    )
    # The client's schema is not changed.
    assert "additionalProperties" not in a
    assert closed_objects(a) is not a


def test_tool_arguments_are_capped_closed_and_may_use_defs(
    tables: tuple[GrammarVocabulary, Any, int],
) -> None:
    """A tool's arguments: numbers capped, objects closed, and `$ref`s into the
    parameters' own `$defs` (pydantic's nested models) resolved where the call's JSON
    puts them (they were refused as "cannot be enforced together")."""
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}},
              "required": ["at"], "$defs": {"Point": {"type": "object", "properties": {
                  "x": {"type": "number"}}, "required": ["x"]}}}  # fmt: skip
    tool = Tool.checked("move", None, params, "tools[0].function.parameters")
    plan = ToolPlan.of((tool,), "required", parallel=False)
    d = Driver(*tables, tool_grammar(plan, None, "response_format"))
    d.feed('<tool_call>\n{"name": "move", "arguments": {"at": {"x": ' + "3" * NUMBER_DIGITS)
    assert not d.allows("3")
    d.feed("}")
    assert not d.allows(",")
