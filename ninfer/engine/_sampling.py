"""Token sampling: logit bias, greedy, temperature, top-k, top-p, min-p, presence,
frequency and repetition (llama.cpp's) penalties; and the log probabilities a request
asks for.

Every sampled row draws from its own `torch.Generator`, seeded per request, and
operates on its own float32 logits row, so a seeded request samples the same
tokens alone, in any batch and in any process (given bit-identical logits, which
the model guarantees in its batch-invariant dtype).

Top-p never sorts the vocabulary. The tokens it keeps are the shortest run of the
most likely ones (equal probabilities in id order) whose mass before each token is
under top_p of the whole; that run is found among a few candidates (the tokens at least
2^-8 of the likeliest one's probability, then 2^-16, ...: a cut that holds the run holds
it as the full sort would), and the draw
runs over the kept tokens alone, in id order, with the same float64 running sums the
whole vocabulary would give (a dropped token adds an exact zero). So the token is the
one a full sort and a draw over the vocabulary pick, from the same generator draw
(tests/test_sampling.py compares the two), at a fraction of the cost: a sort of 49,152
logits took ~5 ms a row.

On the native kernels, a step's rows that sample with top-k in the default order and
nothing that changes their logits first (no penalty, bias or grammar: the server's
defaults) are sampled in one C++ call for the step (`native_sample`,
`torch.ops.ninfer.sample`): the same stages on the row's top-k tokens, with the kernels'
own exponential and float64 sums (`reference_pick` is its definition in float64, which
the self-check and the tests hold it to), one generator draw a row as `pick` takes.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable

import attrs
import torch

from ninfer.engine._contract import DEFAULT_ORDER, SamplingParams, TokenLogprob
from ninfer.engine._grammar import Constraint

__all__ = [
    "RowSampler",
    "logprobs_of",
    "native_sample",
    "native_top_k_ids",
    "native_top_p_kept",
    "near_reference",
    "reference_pick",
    "sample_rows",
    "top_k_ids",
    "top_p_kept",
]

MAX_SEED = 2**63 - 1
# Positive temperatures below this sample as if it were this (already all but greedy).
MIN_TEMPERATURE = 1e-6


@attrs.define(eq=False)
class RowSampler:
    """Per-request sampling state: its generator and its output-token counts."""

    params: SamplingParams
    seed: int
    generator: torch.Generator | None
    counts: torch.Tensor | None  # (V,) float32 counts of output tokens, when penalized
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values) of logit_bias
    # The last repeat_last_n output tokens, when repeats are penalized.
    recent: deque[int] | None = None
    constraint: Constraint | None = None  # the request's grammar, when it has one
    # `top_p_kept`, or the native kernels' copy of it (the same ids; `create`'s
    # `native_top_p`)
    top_p: Callable[[torch.Tensor, float], torch.Tensor] = attrs.field(
        default=lambda probs, p: top_p_kept(probs, p)
    )
    # `top_k_ids`, or the native kernels' copy of it (`create`'s `native_top_k`)
    top_k: Callable[[torch.Tensor, int], torch.Tensor] = attrs.field(
        default=lambda logits, k: top_k_ids(logits, k)
    )
    # The step's batched native sampler may pick this row's tokens (`create`'s
    # `native_sample`; `batchable` says for which parameters)
    native: bool = False

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        vocab_size: int,
        *,
        native_top_p: bool = False,
        native_top_k: bool = False,
        native_sample: bool = False,
    ) -> RowSampler:
        """A request's sampler; `native_top_p`, `native_top_k`: top-p, top-k's tokens on
        the native kernels (loaded); `native_sample`: its picks in the step's one native
        call where `batchable`."""
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        gen = None
        if not params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
        counts = torch.zeros(vocab_size, dtype=torch.float32) if params.penalized else None
        bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            bias = (torch.tensor(ids), torch.tensor(values, dtype=torch.float32))
        recent: deque[int] | None = None
        if params.repeats_penalized:
            recent = deque(maxlen=None if params.repeat_last_n < 0 else params.repeat_last_n)
        sampler = cls(
            params=params, seed=seed, generator=gen, counts=counts, bias=bias, recent=recent
        )
        if native_top_p:
            sampler.top_p = native_top_p_kept
        if native_top_k:
            sampler.top_k = native_top_k_ids
        sampler.native = native_sample
        return sampler

    def batchable(self, vocab_size: int) -> bool:
        """Its picks go to the step's one native call (`native_sample`): top-k in the
        default order, and nothing that changes the logits before it."""
        p = self.params
        return (
            self.native
            and not p.greedy
            and p.order == DEFAULT_ORDER
            and 0 < p.top_k < vocab_size
            and self.counts is None
            and self.recent is None
            and self.bias is None
            and self.constraint is None
        )

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the logits as they come (rows like this share one batched argmax)."""
        return (
            self.params.greedy
            and self.counts is None
            and self.recent is None
            and self.bias is None
            and self.constraint is None
        )

    def observe(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1.0
        if self.recent is not None:
            self.recent.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)

    @property
    def grammar_done(self) -> bool:
        """The request's grammar is complete and allows no further token."""
        return self.constraint is not None and self.constraint.done

    def pick(self, logits: torch.Tensor) -> int:
        """Choose one token from a (V,) float32 logits row."""
        p = self.params
        if self.constraint is not None:  # first: a bias or penalty cannot revive a token
            logits = self.constraint.apply(logits)
        if self.bias is not None:
            logits = logits.index_add(0, self.bias[0], self.bias[1])
        if self.counts is not None:
            logits = logits - p.frequency_penalty * self.counts
            logits = logits - p.presence_penalty * (self.counts > 0).float()
        if self.recent:  # llama.cpp's repetition penalty, with the other penalties
            ids = torch.tensor(sorted(set(self.recent)))
            seen = logits[ids]
            penalized = torch.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
            logits = logits.index_copy(0, ids, penalized)
        if p.greedy:
            return int(torch.argmax(logits))
        if p.order != DEFAULT_ORDER:
            return self._pick_in_order(logits)
        # With top-k, every later stage works on the k tokens it keeps (in id order): a
        # token it drops has probability 0 and adds nothing to a sum or a draw, and on a
        # 262,144-token vocabulary the whole row's softmax, masks and float64 running
        # sum cost 4.4 ms a token (1 ms on SmolLM2's 49,152), k tokens' a few µs.
        candidates: torch.Tensor | None = None
        if p.top_k > 0 and p.top_k < logits.shape[0]:
            candidates = self.top_k(logits, p.top_k)
            logits = logits[candidates]
        # Shift by the maximum first, and divide by at least MIN_TEMPERATURE (a smaller
        # one would round to 0 in float32): any temperature a client may send then gives
        # 0 for the best token and finite or -inf for the rest, never NaN.
        logits = (logits - logits.max()) / max(p.temperature, MIN_TEMPERATURE)
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            kept = self.top_p(probs, p.top_p)
            chosen = int(kept[_draw(probs[kept], self.generator)])
        else:
            chosen = _draw(probs, self.generator)
        return chosen if candidates is None else int(candidates[chosen])

    def _pick_in_order(self, logits: torch.Tensor) -> int:
        """`pick`'s stages in the request's own order (llama-server's `samplers`, and the
        order of a chain a request leaves to the defaults): each filter keeps tokens of
        the row as the stages before it left it (a filter before the temperature sees
        the untempered distribution), the draw is from the last. Where top-k runs
        before top-p (the one later stage it does not commute with), the row is cut to
        top-k's tokens first, as `pick` does, and the other stages see those alone."""
        p = self.params
        order = p.order
        candidates: torch.Tensor | None = None
        if 0 < p.top_k < logits.shape[0] and (
            "top_p" not in order or order.index("top_k") < order.index("top_p")
        ):
            candidates = self.top_k(logits, p.top_k)
            logits = logits[candidates]
            order = tuple(stage for stage in order if stage != "top_k")
        x = logits - logits.max()  # the best token at 0; a dropped one at -inf
        for stage in order:
            if stage == "temperature":
                x = x / max(p.temperature, MIN_TEMPERATURE)
            elif stage == "top_k" and 0 < p.top_k < x.shape[0]:
                x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
            elif stage == "min_p" and p.min_p > 0.0:
                probs = torch.softmax(x, dim=-1)
                x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
            elif stage == "top_p" and p.top_p < 1.0:
                kept = self.top_p(torch.softmax(x, dim=-1), p.top_p)
                x = torch.full_like(x, float("-inf")).index_copy(0, kept, x[kept])
        chosen = _draw(torch.softmax(x, dim=-1), self.generator)
        return chosen if candidates is None else int(candidates[chosen])


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of a (V,) row's k highest logits and of any tied with the k-th, in id order
    (0 < k < V). Taken before the temperature: dividing by a positive temperature keeps
    the order, so these are the tokens top-k keeps after it too."""
    values, ids = torch.topk(logits, k + 1)
    if bool(values[k] == values[k - 1]):  # a tie runs past the k-th: all of it is kept
        return torch.nonzero(logits >= values[k - 1]).view(-1)
    return torch.sort(ids[:k]).values


def native_top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k_ids` on the native kernels (a heap of k over one pass of the row, then the
    ids at or above the k-th: ~0.2 ms on 262,144 logits where torch.topk takes ~1.2):
    the same ids."""
    out: torch.Tensor = torch.ops.ninfer.top_k(logits.float(), k)
    return out


# Top-p looks first among the tokens at least this share of the likeliest one's
# probability, then 2^-8 of that again, ..., then the whole row.
TOP_P_FLOOR = 2.0**-8


def top_p_kept(probs: torch.Tensor, top_p: float, floor: float = TOP_P_FLOOR) -> torch.Tensor:
    """The ids top-p keeps of a (V,) row of probabilities (>= 0), in id order: in order of
    probability (descending; equal ones in id order), each token whose mass before it,
    summed in float64 in that order, is under top_p x the row's total (float64, in id
    order); the likeliest token always. Looked for among the tokens at least `floor` of
    the likeliest one's probability (ties included: every token left out is less likely
    than every one looked at), then floor^2, ..., then all: the answer never depends on
    how many were looked at, only the time (a model's rows are peaked: a few dozen)."""
    total = float(torch.cumsum(probs, 0, dtype=torch.float64)[-1])
    bound = top_p * total
    V = probs.shape[0]
    threshold = float(probs.max()) * floor
    while True:
        candidates = torch.nonzero(probs >= threshold).view(-1) if threshold > 0 else None
        if candidates is None or candidates.numel() == V:
            candidates = torch.arange(V)
        values = probs[candidates]
        order = torch.sort(values, descending=True, stable=True).indices
        ranked = values[order]
        before = torch.cumsum(ranked, 0, dtype=torch.float64) - ranked.double()
        dropped = before >= bound
        dropped[0] = False  # the likeliest token stays, however small top_p is
        if bool(dropped.any()) or candidates.numel() == V:
            # the run ends among the candidates (or they are the whole row)
            kept = candidates[order[~dropped]]
            return torch.sort(kept).values
        threshold = threshold * floor if threshold * floor > 1e-38 else 0.0


def native_top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_kept` on the native kernels (one pass over the row, a sort of the few
    candidates: ~0.05 ms where the torch calls take ~0.3): the same ids, bit for bit."""
    out: torch.Tensor = torch.ops.ninfer.top_p(probs, top_p, TOP_P_FLOOR)
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to `probs` (unnormalized, >= 0):
    inverse CDF over a float64 running sum, one uniform draw from the request's own
    generator. (torch.multinomial costs ~1.3 ms on a 49k vocabulary here; this ~0.07.)
    An index of zero probability is never drawn: it adds no width to the running sum."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= len(cdf):  # u rounded up to the total: the last token with any mass
        index = int(torch.nonzero(probs)[-1])
    return index


def sample_rows(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """One token per row of (B, V) float32 logits; plain greedy rows share one argmax,
    `batchable` rows one native call."""
    assert logits.dim() == 2
    assert logits.shape[0] == len(samplers)
    plain = [s.plain_greedy for s in samplers]
    argmax = torch.argmax(logits, dim=-1).tolist() if any(plain) else []
    V = logits.shape[1]
    batched = [i for i, s in enumerate(samplers) if not plain[i] and s.batchable(V)]
    drawn: dict[int, int] = {}
    if batched:
        picks = native_sample(logits, batched, [samplers[i] for i in batched])
        drawn = dict(zip(batched, picks, strict=True))
    out = []
    for i, s in enumerate(samplers):
        if plain[i]:
            out.append(int(argmax[i]))
        elif i in drawn:
            out.append(drawn[i])
        else:
            out.append(s.pick(logits[i]))
    return out


def _sample_params(s: RowSampler) -> tuple[float, float, float, float]:
    p = s.params
    return (float(p.top_k), max(p.temperature, MIN_TEMPERATURE), p.min_p, p.top_p)


def native_sample(logits: torch.Tensor, rows: list[int], samplers: list[RowSampler]) -> list[int]:
    """One token for each of `rows` of (B, V) float32 logits, row rows[i] by samplers[i]
    (each `batchable`), in one native call: top-k, temperature, min-p and top-p on the
    row's top-k tokens and a draw from the sampler's generator (one a row, as `pick`
    takes), as `reference_pick` defines them."""
    params = torch.tensor([_sample_params(s) for s in samplers], dtype=torch.float64)
    draws = [torch.rand(1, generator=s.generator, dtype=torch.float64) for s in samplers]
    uniform = torch.cat(draws)
    out: torch.Tensor = torch.ops.ninfer.sample(
        logits.float(), torch.tensor(rows, dtype=torch.long), params, uniform
    )
    return [int(t) for t in out.tolist()]


def reference_pick(
    row: torch.Tensor,
    k: int,
    temperature: float,
    min_p: float,
    top_p: float,
    uniform: float,
    slack: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> int:
    """What the native sampler (`native_sample`) picks from a (V,) float32 logits row,
    computed in float64 from the row's values (0 < k < V, temperature > 0): the top-k
    tokens (and ties, in id order); e = exp((logit - max) / temperature); min-p drops
    e < min_p x max e; top-p keeps, most likely first (ties in id order), each token whose
    mass before it is under top_p of the total, the likeliest always; the draw takes the
    first kept token, in id order, whose running sum of e passes uniform x the kept
    total. `slack` moves the draw's target, min-p's floor and top-p's bound by those
    shares of themselves: the native call's float32 exponential may fall on the other
    side of a boundary the float64 one is within ~1e-6 of."""
    ids = top_k_ids(row, k)
    v = row[ids].double()
    best = float(v.max())
    if best == float("-inf"):
        return int(ids[0])
    e = torch.exp((v - best) / temperature)
    if min_p > 0.0:
        e = torch.where(e < min_p * float(e.max()) * (1 + slack[1]), 0.0, e)
    if top_p < 1.0:
        order = torch.sort(e, descending=True, stable=True).indices
        ranked = e[order]
        before = torch.cumsum(ranked, 0) - ranked
        dropped = before >= top_p * float(e.sum()) * (1 + slack[2])
        dropped[0] = False
        e = e.clone()
        e[order[dropped]] = 0.0
    cdf = torch.cumsum(e, 0)
    target = uniform * float(cdf[-1]) * (1 + slack[0])
    past = torch.nonzero(cdf > target).view(-1)
    if past.numel() == 0:
        return int(ids[int(torch.nonzero(e)[-1])])
    return int(ids[int(past[0])])


def near_reference(
    token: int,
    row: torch.Tensor,
    k: int,
    temperature: float,
    min_p: float,
    top_p: float,
    uniform: float,
    reach: float,
) -> bool:
    """Whether `token` is `reference_pick`'s, or its pick with any of the draw's target,
    min-p's floor and top-p's bound moved by `reach` of itself either way (what the
    native sampler may pick where its float32 exponential meets a boundary)."""
    args = (row, k, temperature, min_p, top_p, uniform)
    if token == reference_pick(*args):
        return True
    steps = (-reach, 0.0, reach)
    return any(
        token == reference_pick(*args, slack=(a, b, c)) for a in steps for b in steps for c in steps
    )


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log probability in one (V,) float32 logits row, and the `top` most
    likely tokens'. Computed on the row alone, so as batch-invariant as the row."""
    lp = torch.log_softmax(logits, dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[0]))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), best)
