"""Constrained decoding: a request's grammar masks its row's logits at every step.

llguidance (the grammar engine llama.cpp uses; chosen by measurement, see
docs/benchmarks-history.md) computes, from a grammar and the model's token bytes, which tokens
may come next. The mask is applied to the request's own logits row only, so a
constrained row is computed exactly as it would be alone and batch invariance holds.

Every grammar ninfer compiles holds JSON (structured outputs, `json_object`, tool calls), and
JSON's grammar lets a number run to any length: after a digit, a small model's likeliest
token is often another digit, and its answer never ends. So each row also caps a
number's runs of digits (NUMBER_DIGITS for the integer part and the fraction,
EXPONENT_DIGITS for the exponent; docs/api.md): once a run is at its cap, tokens that
would lengthen it are masked, but only where the grammar is inside a number (every token
it allows then continues or ends one: no letter, no quote) and allows the number to end
there. Where a schema needs more digits (a `minimum` of 10^17, a digit-only pattern), the
grammar allows nothing but digits and the cap gives way, so the cap only ever narrows
the answers to a subset of those the grammar accepts, never to none.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, cast

import llguidance
import torch

from ninfer.engine._contract import CompiledGrammar
from ninfer.engine._tokenizer import TextTokenizer

__all__ = [
    "EXPONENT_DIGITS",
    "NUMBER_DIGITS",
    "Constraint",
    "GrammarTable",
    "GrammarVocabulary",
    "TokenDigits",
    "grammar_tokenizer",
]

_BITS = torch.arange(32, dtype=torch.int32)

# The digits a JSON number's integer part and fraction may each have, and its exponent
# (chosen by measurement: docs/benchmarks.md, "Structured outputs"). 15 keeps every
# integer a double holds exactly up to 10^15 and every fraction a double can tell apart;
# 3 reaches a double's largest exponent (308).
NUMBER_DIGITS = 15
EXPONENT_DIGITS = 3
_DIGITS = b"0123456789"
# The bytes a token may start with after a digit of a number in compact JSON (ninfer's
# grammars allow no free whitespace): more of the number, or what ends it.
_IN_NUMBER = frozenset(b"0123456789.eE+-,}]")


class GrammarVocabulary:
    """What llguidance needs of a tokenizer: each token's bytes, EOS, and encoding."""

    def __init__(
        self, spellings: Sequence[bytes], eos_ids: Sequence[int], bos_id: int | None, encode: object
    ) -> None:
        self.tokens = list(spellings)
        self.eos_token_id = min(eos_ids)
        self.bos_token_id = bos_id
        self.special_token_ids = sorted(eos_ids)
        self._encode = encode

    @classmethod
    def of(cls, tok: TextTokenizer) -> GrammarVocabulary:
        """A model's tokenizer as llguidance sees it: the bytes ninfer streams."""
        spellings = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        return cls(spellings, sorted(tok.eos_ids), tok.bos_id, tok.encode)

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        ids: list[int] = self._encode(s)  # type: ignore[operator]
        return ids[1:] if self.bos_token_id is not None and ids[:1] == [self.bos_token_id] else ids


def grammar_tokenizer(vocab: GrammarVocabulary, n_vocab: int) -> llguidance.LLTokenizer:
    """The engine's token table for llguidance (built once, on the first constrained
    request: 0.2 s for SmolLM2's 49k tokens, 1.5 s for Gemma's 262k)."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocab),
        n_vocab=n_vocab,
        eos_token=vocab.special_token_ids,
    )


class TokenDigits:
    """A vocabulary's tokens as the digit cap sees them (built once, with llguidance's
    token table): each token's leading digits, trailing digits, and whether it starts
    with a byte that no number continues or ends with (a letter, a quote)."""

    def __init__(self, vocab: GrammarVocabulary, n_vocab: int) -> None:
        self.spellings = vocab.tokens
        ends = set(vocab.special_token_ids)
        lead = [0] * n_vocab
        self.trail = [0] * n_vocab
        wordlike = [False] * n_vocab
        for i, b in enumerate(self.spellings[:n_vocab]):
            lead[i] = len(b) - len(b.lstrip(_DIGITS))
            self.trail[i] = len(b) - len(b.rstrip(_DIGITS))
            # An end of turn may end a number.
            wordlike[i] = bool(b) and b[0] not in _IN_NUMBER and i not in ends
        self.lead = torch.tensor(lead, dtype=torch.int32)
        self.max_lead = max(lead, default=0)
        self.wordlike = torch.tensor(wordlike, dtype=torch.bool)


# What llguidance's errors say when it stops at a limit of its own (a row of the Earley
# parser with too many items, a step out of lexer fuel or items), not at a bug.
_LIMIT_MARKS = ("items; max is", "fuel", "max_items", "too many")


class GrammarLimitReached(Exception):
    """The grammar engine gave up on a row at a limit of its own (see GRAMMAR_LIMIT)."""


class Constraint:
    """One request's grammar state: masks its logits row, follows its tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, digits: TokenDigits) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.digits = digits
        # One bit a token, 32 to a word (llguidance's layout; its torch helpers are not
        # imported: that module compiles a kernel with torch.compile at import).
        self._words = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
        self._run = 0  # the digits the output ends with
        self._before = b""  # the (up to) two bytes before them
        self._last = b""  # the output's last two bytes

    @staticmethod
    def compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        """A grammar's matcher in its initial state (ValueError for a grammar llguidance
        refuses). Thread-safe; a large grammar takes hundreds of milliseconds."""
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # The first mask, computed once here: a grammar with no way to begin (a
            # JSON Schema whose $ref leads back to itself) fails only then, and would
            # otherwise stop at once with an empty answer that is not JSON.
            words = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return matcher

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next, less those that would make a
        number's run of digits longer than its cap (see the module's docstring)."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().view(-1)[: self.n_vocab]
        room = self._room()
        if room >= self.digits.max_lead:
            return allowed  # no token can reach past the cap (nearly every step)
        over = self.digits.lead > max(room, 0)  # (past the cap where the schema needs it)
        if not bool((allowed & over).any()) or bool((allowed & self.digits.wordlike).any()):
            return allowed  # nothing to cap, or not inside a number
        capped = allowed & ~over
        return capped if bool(capped.any()) else allowed

    def _room(self) -> int:
        """How many more digits the run the output ends with may take."""
        b = self._before
        exponent = b[-1:] in (b"e", b"E") or (b[-1:] in (b"+", b"-") and b[-2:-1] in (b"e", b"E"))
        return (EXPONENT_DIGITS if exponent else NUMBER_DIGITS) - self._run

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's logits with every token the grammar forbids at -inf."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            if any(mark in error for mark in _LIMIT_MARKS):
                raise GrammarLimitReached(error)
            raise RuntimeError(f"the grammar refused a token it allowed: {error}")
        spelling = self.digits.spellings[token] if token < len(self.digits.spellings) else b""
        if not spelling:
            return
        trail = self.digits.trail[token]
        if trail == len(spelling):
            self._run += trail
        else:
            self._run = trail
            self._before = (self._last + spelling[: len(spelling) - trail])[-2:]
        self._last = (self._last + spelling)[-2:]

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return bool(self.matcher.is_stopped())


class GrammarTable:
    """One model's grammar side: llguidance's table of its tokens and the digit cap's,
    built on first use by whichever thread needs them first (the engine's, or a
    frontend's worker compiling a grammar); then each request's Constraint."""

    def __init__(self, tokenizer: TextTokenizer, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._lock = threading.Lock()
        self._table: llguidance.LLTokenizer | None = None
        self._digits: TokenDigits | None = None

    def _built(self) -> tuple[llguidance.LLTokenizer, TokenDigits]:
        with self._lock:
            if self._table is None or self._digits is None:
                vocab = GrammarVocabulary.of(self._tokenizer)
                self._digits = TokenDigits(vocab, self._n_vocab)
                self._table = grammar_tokenizer(vocab, self._n_vocab)
            return self._table, self._digits

    def compile(self, grammar: str) -> CompiledGrammar:
        """`grammar` compiled on the calling thread (a frontend's worker thread: the
        engine's own would stall every row while a large one compiles)."""
        return CompiledGrammar(grammar, Constraint.compile(self._built()[0], grammar))

    def constraint(self, grammar: str | CompiledGrammar) -> Constraint:
        """A request's Constraint in its grammar's initial state: a copy of a compiled
        grammar's matcher (microseconds), or compiled here from text."""
        table, digits = self._built()
        if isinstance(grammar, CompiledGrammar):  # compiled off the engine's thread
            matcher = cast(Any, grammar.matcher).deep_copy()
        else:
            matcher = Constraint.compile(table, grammar)
        return Constraint(matcher, self._n_vocab, digits)
