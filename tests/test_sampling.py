"""The sampler's draw: the right distribution, never a token without mass, reproducible;
top-p found among a few candidates keeps what a sort of the whole row keeps."""

from __future__ import annotations

from collections import Counter

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine import SamplingParams
from ninfer.engine._sampling import RowSampler, _draw, top_p_kept


def test_draw_follows_the_probabilities_and_skips_zeros() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    n = 20_000
    counts = Counter(_draw(probs, gen) for _ in range(n))
    assert set(counts) == {1, 3, 4}
    for index, p in ((1, 0.1), (3, 0.6), (4, 0.3)):
        # Five standard deviations of a binomial count: fails by chance ~1e-6 (and the
        # seed is fixed, so it never flickers).
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(counts[index] - n * p) < 5 * sd


def test_unnormalized_and_one_hot() -> None:
    gen = torch.Generator().manual_seed(1)
    assert {_draw(torch.tensor([0.0, 0.0, 5.0]), gen) for _ in range(50)} == {2}
    assert {_draw(torch.tensor([2.0, 0.0, 2.0]), gen) for _ in range(200)} == {0, 2}


def test_a_seed_repeats_its_tokens() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42)
    runs = []
    for _ in range(2):
        sampler = RowSampler.create(params, vocab_size=1000)
        runs.append([sampler.pick(logits) for _ in range(30)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


def _kept_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p as a sort of the whole row defines it (the reference): in order of
    probability (equal ones in id order), the tokens whose mass before them, summed in
    float64, is under top_p of the row's total; the likeliest always. Ids in id order."""
    total = float(torch.cumsum(probs, 0, dtype=torch.float64)[-1])
    order = torch.sort(probs, descending=True, stable=True).indices
    ranked = probs[order]
    before = torch.cumsum(ranked, 0, dtype=torch.float64) - ranked.double()
    dropped = before >= top_p * total
    dropped[0] = False
    return torch.sort(order[~dropped]).values


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    top_p=st.floats(0.01, 0.999),
    floor=st.sampled_from([0.9, 0.5, 2.0**-8, 1e-6]),
    sharpness=st.floats(0.1, 8.0),
    ties=st.booleans(),
)
def test_top_p_from_a_few_candidates_keeps_what_a_full_sort_keeps(
    seed: int, top_p: float, floor: float, sharpness: float, ties: bool
) -> None:
    """Looking among the tokens at least `floor` of the likeliest (then floor^2, ...)
    keeps exactly the tokens a sort of the whole row keeps: flat and peaked rows, rows
    full of equal probabilities (ties at the cut keep the lower ids, as the stable sort
    does)."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(seed)) * sharpness
    if ties:
        logits = torch.round(logits)  # many equal probabilities
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(top_p_kept(probs, top_p, floor), _kept_by_full_sort(probs, top_p))


def test_a_top_p_draw_picks_what_a_draw_over_the_whole_row_picks() -> None:
    """The draw over the kept tokens alone gives, from the same generator, the token a
    draw over the whole row (the dropped ones zeroed) gives: the float64 running sums
    agree at every kept token."""
    for seed in range(200):
        logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * 2
        probs = torch.softmax(logits, dim=-1)
        kept = top_p_kept(probs, 0.9)
        whole = torch.zeros_like(probs)
        whole[kept] = probs[kept]
        a = int(kept[_draw(probs[kept], torch.Generator().manual_seed(seed))])
        b = _draw(whole, torch.Generator().manual_seed(seed))
        assert a == b


def test_the_repetition_penalty_divides_and_multiplies_the_recent_tokens() -> None:
    """llama.cpp's repeat_penalty: a token among the last repeat_last_n output tokens
    has its logit divided by the penalty where positive, multiplied where negative;
    one that left the window is itself again."""
    params = SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=2)
    sampler = RowSampler.create(params, 6)
    assert not sampler.plain_greedy
    logits = torch.tensor([0.0, 1.5, -1.0, -0.4, 0.5, 2.0])
    assert sampler.pick(logits) == 5
    sampler.observe(5)  # 2.0 -> 1.0: token 1 (1.5) now leads
    assert sampler.pick(logits) == 1
    sampler.observe(1)  # 1.5 -> 0.75, 2.0 -> 1.0: 5 again
    assert sampler.pick(logits) == 5
    sampler.observe(3)  # the window (2) now holds 1 and 3: 5 is back to 2.0
    assert sampler.pick(logits) == 5
    negative = RowSampler.create(params, 6)
    negative.observe(0)
    negative.observe(3)
    # 0.0 stays 0.0 (neither positive nor negative); -0.4 -> -0.8
    assert negative.pick(torch.tensor([0.0, -0.5, -1.0, -0.4, -0.9, -0.6])) == 0
    # -0.3 -> -0.6 and -0.4 -> -0.8: the unpenalized -0.5 leads
    assert negative.pick(torch.tensor([-0.3, -0.5, -1.0, -0.4, -0.9, -0.6])) == 1
    off = RowSampler.create(SamplingParams(temperature=0.0, repeat_penalty=1.0), 6)
    assert off.plain_greedy  # 1.0: no penalty, the batched argmax


def test_top_k_keeps_the_k_highest_and_every_tie_with_the_kth() -> None:
    from ninfer.engine._sampling import top_k_ids

    row = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0, 2.0, 2.0, float("-inf"), 1.0])
    assert top_k_ids(row, 1).tolist() == [1, 3]  # the best is tied: both
    assert top_k_ids(row, 2).tolist() == [1, 3]
    assert top_k_ids(row, 3).tolist() == [1, 3, 4, 5, 6]  # the 3rd ties the 4th and 5th
    assert top_k_ids(row, 6).tolist() == [1, 3, 4, 5, 6, 8]
    assert top_k_ids(row, 7).tolist() == [0, 1, 3, 4, 5, 6, 8]
    masked = torch.tensor([float("-inf")] * 5 + [1.0])
    assert top_k_ids(masked, 2).tolist() == [0, 1, 2, 3, 4, 5]  # -inf ties: all kept


def _whole_row_pick(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The default chain over the whole row (the reference for the sampler, which works
    on the top-k tokens only): tempered, everything under the k-th highest masked,
    softmax, min-p, top-p by a full sort, one draw over the row in id order."""
    x = (logits - logits.max()) / p.temperature
    x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    kept = _kept_by_full_sort(probs, p.top_p)
    return int(kept[_draw(probs[kept], gen)])


def test_the_top_k_tokens_alone_draw_what_the_whole_row_draws() -> None:
    """With top-k on, the sampler's later stages see only the k tokens top-k keeps:
    over many rows and seeds it draws the token the same chain over the whole row draws
    with the same generator (a dropped token has no mass, so the running sum over the
    row is the sum over those tokens, in the same order)."""
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    rows = torch.Generator().manual_seed(5)
    for seed in range(200):
        logits = torch.randn(5000, generator=rows) * (1 + seed % 7)
        sampler = RowSampler.create(attrs.evolve(p, seed=seed), 5000)
        got = [sampler.pick(logits) for _ in range(3)]
        gen = torch.Generator().manual_seed(seed)
        assert got == [_whole_row_pick(logits, p, gen) for _ in range(3)], seed


def _whole_row_in_order(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """A chain in `p.order` over the whole row (the reference for the sampler, which cuts
    the row to top-k's tokens first where top-k runs before top-p): each stage masks what
    it drops to -inf, top-p by a full sort of what the stages before it left, one draw
    over the row in id order."""
    x = logits - logits.max()
    for stage in p.order:
        if stage == "temperature":
            x = x / p.temperature
        elif stage == "top_k":
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        elif stage == "min_p":
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        else:
            kept = _kept_by_full_sort(torch.softmax(x, dim=-1), p.top_p)
            x = torch.full_like(x, float("-inf")).index_copy(0, kept, x[kept])
    return _draw(torch.softmax(x, dim=-1), gen)


def test_llama_servers_order_on_the_top_k_tokens_draws_what_the_whole_row_draws() -> None:
    """llama-server's order (top-k, top-p, min-p, then the temperature: what a request
    naming no filter runs) on top-k's tokens alone draws, over many rows and seeds and
    temperatures on both sides of 1, the token that order over the whole row draws with
    the same generator; so does an order with top-p before top-k, which the sampler runs
    over the whole row."""
    llama = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                           order=("top_k", "top_p", "min_p", "temperature"))  # fmt: skip
    rows = torch.Generator().manual_seed(7)
    for seed in range(200):
        logits = torch.randn(5000, generator=rows) * (1 + seed % 7)
        temperature = (0.3, 0.8, 1.0, 1.7)[seed % 4]
        for p in (
            attrs.evolve(llama, temperature=temperature, seed=seed),
            attrs.evolve(llama, temperature=temperature, seed=seed, top_p=0.5,
                         order=("top_p", "temperature", "top_k", "min_p")),
        ):  # fmt: skip
            sampler = RowSampler.create(p, 5000)
            got = [sampler.pick(logits) for _ in range(3)]
            gen = torch.Generator().manual_seed(seed)
            assert got == [_whole_row_in_order(logits, p, gen) for _ in range(3)], (seed, p)
