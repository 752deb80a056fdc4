"""A request's row in the engine (ninfer/engine/_sequence.py), with no model: its stop
rules in their order, the deltas it sends, how it ends, and which requests can never
run."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from ninfer.engine._contract import (
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from ninfer.engine._errors import RequestInvalid
from ninfer.engine._sampling import RowSampler
from ninfer.engine._sequence import Row, check_request
from ninfer.engine._textstream import TextStream

EOS = 0
VOCAB = 8
# Token t spells one letter; 0 (EOS) spells nothing.
LETTERS = " abcdefg"


def _decode(ids: Sequence[int]) -> str:
    return "".join(LETTERS[t] for t in ids if t != EOS)


def _row(max_new: int = 8, prompt: int = 3, **request: object) -> Row:
    req = GenerationRequest("r", tuple(range(1, prompt + 1)), max_new, **request)  # type: ignore[arg-type]
    row = Row(
        handle=RequestHandle(id=1, request_id="r"),
        request=req,
        sampler=RowSampler.create(req.sampling, VOCAB),
        text=TextStream(decode=_decode, stops=req.stop),
        submitted=0.0,
    )
    row.position = prompt
    return row


def _feed(row: Row, tokens: Sequence[int], max_context: int = 64) -> list[str | None]:
    reasons: list[str | None] = []
    for token in tokens:
        reasons.append(row.accept(token, None, eos_ids={EOS}, max_context=max_context))
        row.position += 1
        if reasons[-1] is not None:
            break
    return reasons


def test_a_row_goes_on_until_a_rule_ends_it() -> None:
    row = _row()
    assert _feed(row, [1, 2, 3]) == [None, None, None]
    assert row.generated == 3
    assert row.output_ids == [1, 2, 3]
    assert row.last_token == 3


def test_eos_ends_it_unless_ignored() -> None:
    assert _feed(_row(), [1, EOS]) == [None, "eos"]
    ignoring = _row(ignore_eos=True)
    assert _feed(ignoring, [1, EOS, 2]) == [None, None, None]


def test_a_stop_string_ends_it_and_its_text_stops_before_it() -> None:
    row = _row(stop=("cd",))
    assert _feed(row, [1, 3, 4, 5]) == [None, None, "stop"]
    last = row.final_delta("stop")
    assert last is not None
    assert last.text == "a"  # what comes before the stop string, nothing of it
    finish = row.finish("stop", None, "none")
    assert finish.stop_string == "cd"
    assert finish.reason == "stop"


def test_the_budget_ends_it_before_the_context() -> None:
    """The context rule ends a row on the token whose position would be past the window
    (it is sent, never written); on a token that reaches both, the budget is the reason."""
    assert _feed(_row(max_new=2), [1, 2, 3]) == [None, "length"]
    # prompt 3, window 5: the 3rd token sits at position 5, past it.
    assert _feed(_row(max_new=8), [1, 2, 3, 4], max_context=5) == [None, None, "context"]
    assert _feed(_row(max_new=3), [1, 2, 3, 4], max_context=5) == [None, None, "length"]


def test_eos_comes_before_the_budget_and_reports_no_logprob() -> None:
    row = _row(max_new=1, logprobs=1)
    scored = TokenLogprob(token_id=EOS, logprob=-0.1, top=())
    assert row.accept(EOS, scored, eos_ids={EOS}, max_context=64) == "eos"
    assert row.pending_lps == []


def test_deltas_carry_the_pending_tokens_once() -> None:
    row = _row(logprobs=1)
    row.cached = 16
    for t in (1, 2):
        scored = TokenLogprob(token_id=t, logprob=-1.0, top=())
        assert row.accept(t, scored, eos_ids={EOS}, max_context=64) is None
        row.position += 1
    first = row.step_delta()
    assert first.token_ids == (1, 2)
    assert first.text == "ab"
    assert first.cached_tokens == 16  # the first delta only
    assert first.logprobs is not None
    assert [lp.token_id for lp in first.logprobs] == [1, 2]
    assert row.accept(3, None, eos_ids={EOS}, max_context=64) is None
    second = row.step_delta()
    assert second.token_ids == (3,)
    assert second.cached_tokens is None


def test_a_cancelled_row_sends_nothing_more_and_one_finish() -> None:
    row = _row()
    _feed(row, [1, 2])
    assert row.final_delta("cancelled") is None
    assert row.pending_ids == []
    finish = row.finish("cancelled", None, "none")
    assert finish.usage.prompt_tokens == 3
    assert finish.usage.completion_tokens == 2
    assert finish.seed is None  # greedy


def test_a_finished_row_sends_its_held_back_text() -> None:
    """Text that could begin a stop string is held back while the row goes on, and
    sent when it ends for another reason."""
    row = _row(max_new=2, stop=("bz",))
    assert _feed(row, [1, 2]) == [None, "length"]
    last = row.final_delta("length")
    assert last is not None
    assert last.text == "ab"
    assert last.token_ids == (1, 2)


def test_a_sampled_row_reports_its_seed() -> None:
    row = _row(sampling=SamplingParams(temperature=1.0, seed=7))
    assert row.finish("length", None, "none").seed == 7


def test_pages_as_the_engine_lays_them_out() -> None:
    row = _row(max_new=20, prompt=5)
    assert row.reserved_pages(16) == 2  # 5 + 20 tokens
    row.pages = [4, 9]
    assert row.page_row(4) == [4, 9, 0, 0]
    _feed(row, [1, 2])
    assert row.written() == [1, 2, 3, 4, 5, 1, 2]


@pytest.mark.parametrize(
    ("prompt", "max_new", "reserve", "param", "words"),
    [
        ((), 4, None, "prompt", "no tokens"),
        ((1,), 0, None, "max_new_tokens", "at least 1"),
        ((1, VOCAB), 4, None, "prompt", "outside the vocabulary"),
        ((1,) * 60, 8, None, "max_new_tokens", "context window of 64"),
        ((1,), 4, 5, "max_new_tokens", "reserve_tokens"),
        ((1,) * 40, 8, None, "max_new_tokens", "needs 3 KV pages; the pool has 2"),
    ],
)
def test_requests_that_can_never_run_are_refused_by_name(
    prompt: tuple[int, ...], max_new: int, reserve: int | None, param: str, words: str
) -> None:
    request = GenerationRequest("r", prompt, max_new, reserve_tokens=reserve)
    with pytest.raises(RequestInvalid, match=words) as refused:
        check_request(request, vocab=VOCAB, max_context=64, kv_pages=2, page_size=16)
    assert refused.value.param == param
