"""Speculative decoding that never changes a token: drafts, and the pass that verifies them.

A row with a draft d1..dk is run as one group of k + 1 positions (its last token, then
the draft) beside the step's other rows. The position before each draft token gives
the logits a plain one-token step would have given there, bit for bit: every matmul
computes a row the same in any number of rows (measured at start-up up to the most
rows a pass can have, `rows_independent_of_count`), attention computes each query row
alone over its own keys (`_model._grouped_attention`), and the self-check compares a
verifying pass with plain steps on the real model before the engine serves
(`SelfCheck.speculative`). The engine then samples those logits one position at a
time with the row's own sampler, as plain steps would (the same generator draws, the
same penalties and grammar state), and keeps the tokens up to the first one that
differs from the draft: the output is the output without speculation, token for
token, greedy or seeded. Nothing is accepted by a probability ratio.

Drafts come without a second model:

- `NgramIndex` looks the row's last few tokens up in its own prompt and output (prompt
  lookup, llama.cpp's `ngram-simple`): an answer that quotes or edits its prompt, or
  repeats itself, is drafted from what followed the same tokens before;
- a constrained row's grammar drafts the tokens it forces (JSON keys, closing
  brackets, tool-call markup: llguidance's fast-forward tokens), and an n-gram draft of
  a constrained row is cut where the grammar would refuse it.

A row whose drafts keep failing drafts less and then pauses (`RowSpeculation`), so
free text, where lookups rarely hit, costs little more than plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ninfer.engine._contract import SpeculativeCounts
from ninfer.engine._model import KVPages, Transformer

__all__ = [
    "NgramIndex",
    "RowSpeculation",
    "step_logits",
]

# Lookup lengths: the longest suffix of the row's tokens (up to NGRAM_MAX) seen before
# with a token after it is followed; a suffix shorter than NGRAM_MIN never drafts (one
# token repeats too often in free text to predict what follows it).
NGRAM_MAX = 4
NGRAM_MIN = 2
# After a round that accepted nothing a row pauses drafting for 2, 4, ... steps, up to
# this many.
MAX_PAUSE = 32

Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a token history last occurred
    with a token after it: one dictionary update per token and length."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of its follower
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        end = len(self.tokens)  # the n-grams ending before `token` now have a follower
        for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
            self._next[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """k tokens that followed the longest suffix's last earlier occurrence (where they
        run into the suffix itself, the history repeats with that period: a loop is
        drafted whole)."""
        tokens = self.tokens
        for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
            at = self._next.get(tuple(tokens[-n:]))
            if at is not None:
                period = len(tokens) - at
                return [tokens[at + i % period] for i in range(k)]
        return []


@attrs.define(eq=False)
class RowSpeculation:
    """One request's drafting: its history's n-gram index (built on its first draft),
    its current draft length, its pause after failed rounds, and its counters."""

    window: int  # --draft-tokens
    history: Sequence[int]  # the prompt, until the index is built
    index: NgramIndex | None = None
    prompt_length: int = 0  # of the history the index began with
    length: int = 0  # the next draft's length (0: the window)
    pause: int = 0  # steps left without drafting
    misses: int = 0  # rounds in a row that accepted nothing
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_steps: int = 0
    per_position: list[int] = attrs.field(factory=list)

    def propose(self, limit: int, constraint: Any | None, output: Sequence[int]) -> list[int]:
        """This step's draft (at most `limit` tokens; [] for a plain step). `output`:
        the tokens sampled so far (the index catches up with them). A grammar's forced
        tokens are drafted even while n-gram drafting pauses: they are rarely wrong."""
        if limit <= 0:
            return []
        if self.index is None:
            self.index = NgramIndex(self.history)
            self.prompt_length = len(self.history)
            self.history = ()
        index = self.index
        for t in output[len(index.tokens) - self.prompt_length :]:
            index.append(t)
        k = min(limit, self.length or self.window)
        if constraint is not None:
            forced = list(constraint.matcher.compute_ff_tokens())[:k]
            if forced:
                return forced
        if self.pause > 0:
            self.pause -= 1
            return []
        draft = index.draft(k)
        if draft and constraint is not None:
            draft = draft[: constraint.matcher.validate_tokens(draft)]
        return draft

    def begin(self, drafted: int) -> None:
        """A round verifying `drafted` tokens starts (counted before its tokens are taken:
        a token may end the request, whose counts are then final)."""
        self.rounds += 1
        self.drafted += drafted
        if len(self.per_position) < self.window:
            self.per_position += [0] * (self.window - len(self.per_position))

    def keep(self, position: int) -> None:
        """The round's drafted token at `position` (0-based) was kept."""
        self.accepted += 1
        self.per_position[position] += 1

    def adapt(self, drafted: int, accepted: int) -> None:
        """After a round: draft longer when it kept all, shorter when not; pause after
        a round that kept nothing, twice as long each time in a row."""
        current = self.length or self.window
        if accepted == drafted:
            self.length = min(self.window, current + 2)
        else:
            self.length = max(1, current - 1)
        if accepted == 0:
            self.misses += 1
            self.pause = min(2**self.misses, MAX_PAUSE)
        else:
            self.misses = 0

    def record(self, drafted: int, accepted: int) -> None:
        """A whole verified round: `accepted` of its `drafted` tokens were kept."""
        self.begin(drafted)
        for i in range(accepted):
            self.keep(i)
        self.adapt(drafted, accepted)

    def counts(self, backend: str) -> SpeculativeCounts:
        return SpeculativeCounts(
            backend=backend,
            draft_window=self.window,
            rounds=self.rounds,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            fallback_steps=self.fallback_steps,
            accepted_per_position=tuple(self.per_position or [0] * self.window),
        )


def step_logits(
    model: Transformer, kv: KVPages, plain: Group | None, drafts: Sequence[Group]
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """One decode pass: `plain`, a decode batch (B, 1) as the engine pads it, and each
    row with a draft as a group (1, k + 1) of its own. Returns the plain rows' (B, V)
    float32 logits (host memory) and each drafted row's (k + 1, V): every position's,
    computed as a one-token step at that position computes them. The head runs once
    over all of them (its rows do not depend on how many: measured at start-up)."""
    if not drafts:  # a plain step: `forward`, as ever
        assert plain is not None
        return model.forward(*plain, kv, last_only=True).float().cpu(), []
    groups = ([plain] if plain is not None else []) + list(drafts)
    xs = model.hidden_many(groups, kv)
    rows = ([xs[0][:, -1]] if plain is not None else []) + [
        x[0] for x in xs[len(xs) - len(drafts) :]
    ]
    logits = model.logits(rows[0] if len(rows) == 1 else torch.cat(rows)).float().cpu()
    out_plain = None
    at = 0
    if plain is not None:
        at = int(plain[0].shape[0])
        out_plain = logits[:at]
    spans = []
    for g in drafts:
        n = int(g[0].shape[1])
        spans.append(logits[at : at + n])
        at += n
    return out_plain, spans
