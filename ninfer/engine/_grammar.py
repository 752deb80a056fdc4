"""Constrained decoding: a request's grammar masks its row's logits at every step.

llguidance (the grammar engine llama.cpp uses; chosen by measurement, see
docs/benchmarks-history.md) computes, from a grammar and the model's token bytes, which tokens
may come next. The mask is applied to the request's own logits row only, so a
constrained row is computed exactly as it would be alone and batch invariance holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from ninfer.engine._tokenizer import TextTokenizer

__all__ = ["Constraint", "GrammarVocabulary", "grammar_tokenizer"]

_BITS = torch.arange(32, dtype=torch.int32)


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


# What llguidance's errors say when it stops at a limit of its own (a row of the Earley
# parser with too many items, a step out of lexer fuel or items), not at a bug.
_LIMIT_MARKS = ("items; max is", "fuel", "max_items", "too many")


class GrammarLimitReached(Exception):
    """The grammar engine gave up on a row at a limit of its own (see GRAMMAR_LIMIT)."""


class Constraint:
    """One request's grammar state: masks its logits row, follows its tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        # One bit a token, 32 to a word (llguidance's layout; its torch helpers are not
        # imported: that module compiles a kernel with torch.compile at import).
        self._words = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)

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
        """(V,) bool: the tokens the grammar allows next."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return ((words.unsqueeze(-1) >> _BITS) & 1).bool().view(-1)[: self.n_vocab]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's logits with every token the grammar forbids at -inf."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error()
            if any(mark in error for mark in _LIMIT_MARKS):
                raise GrammarLimitReached(error)
            raise RuntimeError(f"the grammar refused a token it allowed: {error}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return bool(self.matcher.is_stopped())
