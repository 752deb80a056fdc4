"""Speculative decoding that never changes a token: drafts, and the pass that verifies them.

A row with a draft d1..dk runs as k + 1 positions (its last token, then the draft), in
a group with the other rows whose drafts have its length, beside the step's plain
rows. The position before each draft token gives
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

Each step drafts only what is likely to pay for its rows in the pass (`plan_drafts`,
from the pass cost measured at start-up and each row's recent acceptance), and a row
whose round kept nothing pauses (`RowSpeculation`): free text, where lookups rarely
hit, and large batches, where rows cost what they are likely to give, cost little
more than plain decoding.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import torch

from ninfer.engine._contract import SpeculativeCounts
from ninfer.engine._kvpool import KVPages
from ninfer.engine._model import Transformer

__all__ = [
    "NgramIndex",
    "RowSpeculation",
    "by_length",
    "group_lengths",
    "plan_drafts",
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
# A row's acceptance counts decay by this much a round (about its last 5 rounds).
RECENT_DECAY = 0.8


# What verifying a drafted token costs beyond its row in the pass (its sampling on
# its own, its group's attention calls, clearing what a rejected one wrote), as a
# share of a row's cost: measured on SmolLM2, 16 rows, 2 cores.
VERIFY_OVERHEAD = 0.5


def plan_drafts(chances: Sequence[float], limits: Sequence[int], row_cost: float) -> list[int]:
    """How many tokens each of a step's rows drafts, for the most tokens per second.

    A pass of r rows costs about c0 + c1 x r (`row_cost` = c0 / c1, measured at start-
    up); each row gives one token, and a drafted token costs a row (and VERIFY_OVERHEAD
    more) and gives its chance of being kept: the i-th token of a row's draft is kept
    only if the i - 1 before it are, `chances[row]` ** i. Drafted tokens are added, the
    most likely first, while each raises the step's tokens per unit of cost; a row
    drafts at most `limits[row]`. Alone on the 2-core CPU (c0 / c1 about 9 for SmolLM2)
    a row whose drafts are kept 85% of the time drafts 6; among 16 rows, drafting pays
    only for drafts kept more than 90% of the time. On a GPU, where rows are nearly
    free, almost every draft pays."""
    tokens, cost = float(len(chances)), row_cost + len(chances)
    plan = [0] * len(chances)
    heap = [(-q, row) for row, q in enumerate(chances) if limits[row] > 0 and q > 0]
    heapq.heapify(heap)
    while heap:
        value, row = heapq.heappop(heap)
        value = -value
        if value * cost <= tokens * (1 + VERIFY_OVERHEAD):
            break  # the likeliest token left lowers the step's rate: so would the rest
        tokens += value
        cost += 1 + VERIFY_OVERHEAD
        plan[row] += 1
        if plan[row] < limits[row]:
            heapq.heappush(heap, (-value * chances[row], row))
    return plan


def group_lengths(drafts: list[list[int]]) -> list[list[int]]:
    """Where a step's drafts have more than two lengths, each is cut to its longest
    power-of-two prefix: rows whose drafts have one length verify as one group (one
    attention call a layer; a group costs about a row's time), so a step has at most
    log2(window) + 1 groups."""
    if len({len(d) for d in drafts if d}) <= 2:
        return drafts
    return [d[: 1 << (len(d).bit_length() - 1)] if d else d for d in drafts]


R = TypeVar("R")  # a row, as the engine keeps it


def by_length(rows: Sequence[R], drafts: Sequence[list[int]]) -> list[list[tuple[R, list[int]]]]:
    """The rows with a draft, with it, grouped by its length (one verifying group each),
    in the order each length first occurs."""
    groups: dict[int, list[tuple[R, list[int]]]] = {}
    for row, draft in zip(rows, drafts, strict=True):
        if draft:
            groups.setdefault(len(draft), []).append((row, draft))
    return list(groups.values())


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
    its pause after failed rounds, how often its drafted tokens are kept, and its
    counters."""

    window: int  # --draft-tokens
    history: Sequence[int]  # the prompt, until the index is built
    index: NgramIndex | None = None
    prompt_length: int = 0  # of the history the index began with
    pause: int = 0  # steps left without drafting
    misses: int = 0  # rounds in a row that accepted nothing
    # Drafted tokens kept, and tokens judged (kept ones and the first wrong one of a
    # round), as decaying sums: their ratio is the chance a drafted token is kept.
    kept_recent: float = 0.0
    judged_recent: float = 0.0
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
        k = min(limit, self.window)
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

    def acceptance(self, prior: float) -> float:
        """The chance this row's next drafted token is kept (its recent rounds, with
        `prior`, the engine's recent rate, counted as one more token judged)."""
        return (self.kept_recent + prior) / (self.judged_recent + 1.0)

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
        """After a round: its tokens judged join the row's acceptance; after a round
        that kept nothing the row pauses, twice as long each time in a row."""
        judged = accepted + (1 if accepted < drafted else 0)
        self.kept_recent = RECENT_DECAY * self.kept_recent + accepted
        self.judged_recent = RECENT_DECAY * self.judged_recent + judged
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
    """One decode pass: `plain`, a decode batch (B, 1) as the engine pads it, and groups
    of rows verifying drafts, (n, k + 1) each (the rows whose drafts have one length:
    attention runs once a group, and computes each row alone in it). Returns the plain
    rows' (B, V) float32 logits (host memory) and each draft group's (n, k + 1, V):
    every position's, computed as a one-token step at that position computes them. The
    head runs once over all of them (its rows do not depend on how many: measured at
    start-up)."""
    if not drafts:  # a plain step: `forward`, as ever
        assert plain is not None
        return model.forward(*plain, kv, last_only=True).float().cpu(), []
    groups = ([plain] if plain is not None else []) + list(drafts)
    xs = model.hidden_many(groups, kv)
    rows = ([xs[0][:, -1]] if plain is not None else []) + [
        x.reshape(-1, x.shape[-1]) for x in xs[len(xs) - len(drafts) :]
    ]
    logits = model.logits(rows[0] if len(rows) == 1 else torch.cat(rows)).float().cpu()
    out_plain = None
    at = 0
    if plain is not None:
        at = int(plain[0].shape[0])
        out_plain = logits[:at]
    spans = []
    for g in drafts:
        n, t = (int(d) for d in g[0].shape)
        spans.append(logits[at : at + n * t].view(n, t, -1))
        at += n * t
    return out_plain, spans
