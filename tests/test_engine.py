"""The engine thread: exact batches, cancellation, stops, one finish per request."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from conftest import (
    FAILING_SEED,
    HANG_GUARD_S,
    RunningEngine,
    crowd_out,
    plant_sampling_failure,
    start_engine,
    stop_engine,
)
from tinymodel import write_tiny_gguf

from ninfer._errors import RequestInvalid
from ninfer.engine import (
    EngineConfig,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenDelta,
)
from ninfer.engine._kvpool import pages_for


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(3 + (i * 7 + salt * 13) % 250 for i in range(n))


def _requests() -> list[GenerationRequest]:
    reqs = []
    for i in range(8):
        sampling = (
            SamplingParams()
            if i % 2 == 0
            else SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=100 + i)
        )
        reqs.append(
            GenerationRequest(
                request_id=f"r{i}",
                prompt_ids=_prompt(5 + 9 * i, salt=i),
                max_new_tokens=24 + i,
                sampling=sampling,
                ignore_eos=True,
            )
        )
    return reqs


def test_batching_never_changes_a_token(tiny_engine: RunningEngine) -> None:
    """Eight requests of different prompt lengths, submitted at different moments and decoded
    together, get exactly the tokens each gets alone: greedy and seeded sampling alike."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    alone = []
    for req in _requests():
        h = eng.submit(req)
        sink.wait_done(h)
        alone.append(sink.tokens[h.id])
    handles: list[RequestHandle] = []
    for req in _requests():
        handles.append(eng.submit(req))
        # Let the previous request get some tokens out before the next one arrives.
        first = handles[-1]
        sink.wait_for(lambda h=first: len(sink.tokens.get(h.id, [])) >= 3)  # type: ignore[misc]
    finishes = sink.wait_done(*handles)
    together = [sink.tokens[h.id] for h in handles]
    assert together == alone
    assert [f.reason for f in finishes] == ["length"] * 8
    assert [f.usage.completion_tokens for f in finishes] == [24 + i for i in range(8)]
    assert max(len(a.token_ids) for _, a in sink.events if hasattr(a, "token_ids")) >= 1


def test_seeded_request_repeats_and_unseeded_differs(tiny_engine: RunningEngine) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    params = SamplingParams(temperature=1.0, seed=7)
    req = GenerationRequest("s", _prompt(10), 30, params, ignore_eos=True)
    a, b = eng.submit(req), eng.submit(req)
    fa, fb = sink.wait_done(a, b)
    assert sink.tokens[a.id] == sink.tokens[b.id]
    assert fa.seed == fb.seed == 7
    other = eng.submit(
        GenerationRequest(
            "s", _prompt(10), 30, SamplingParams(temperature=1.0, seed=8), ignore_eos=True
        )
    )
    sink.wait_done(other)
    assert sink.tokens[other.id] != sink.tokens[a.id]


def test_cancel_mid_decode_frees_the_row_and_pages(tiny_engine: RunningEngine) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    total = eng.statistics().pages_total
    keep = eng.submit(GenerationRequest("keep", _prompt(12), 200, ignore_eos=True))
    gone = eng.submit(GenerationRequest("gone", _prompt(20), 200, ignore_eos=True))
    sink.wait_for(lambda: len(sink.tokens.get(gone.id, [])) >= 5)
    eng.cancel(gone)
    (fin,) = sink.wait_done(gone)
    assert fin.reason == "cancelled"
    produced = len(sink.tokens[gone.id])
    assert fin.usage.completion_tokens == produced
    sink.wait_for(lambda: len(sink.tokens.get(keep.id, [])) >= produced + 20)
    assert len(sink.tokens[gone.id]) == produced, "no event after the cancel"
    stats = eng.statistics()
    assert stats.decoding == 1
    assert stats.pages_used == pages_for(12 + 200, eng.config.page_size)
    eng.cancel(keep)
    sink.wait_done(keep)
    assert eng.statistics().pages_free == total


def test_finish_reasons_and_usage(tiny_engine: RunningEngine) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    length = eng.submit(GenerationRequest("l", _prompt(4), 5, ignore_eos=True))
    (f,) = sink.wait_done(length)
    assert (f.reason, f.usage.prompt_tokens, f.usage.completion_tokens) == ("length", 4, 5)
    assert len(sink.tokens[length.id]) == 5
    # A stop string that the greedy continuation produces: take a piece of its own text.
    text = "".join(sink.text[length.id])
    probe = eng.submit(GenerationRequest("p", _prompt(4), 40, ignore_eos=True))
    sink.wait_done(probe)
    full = "".join(sink.text[probe.id])
    assert full.startswith(text)
    stop = full[10:13]
    stopped = eng.submit(GenerationRequest("st", _prompt(4), 40, stop=(stop,), ignore_eos=True))
    (fs,) = sink.wait_done(stopped)
    assert fs.reason == "stop"
    assert fs.stop_string == stop
    assert "".join(sink.text[stopped.id]) == full[: full.index(stop)]


def test_eos_ends_a_request(tiny_gguf: Path) -> None:
    """With eos honoured, a request that samples an eos id finishes 'eos' and keeps the id."""
    running = start_engine(tiny_gguf, EngineConfig(max_batch=4, kv_capacity=2048, page_size=16))
    try:
        eng, sink = running.engine, running.sink
        eos = min(running.model.tokenizer.eos_ids)
        # Sample at a very high temperature until some request draws an eos id.
        handles = [
            eng.submit(
                GenerationRequest(
                    f"e{i}", _prompt(6, i), 200, SamplingParams(temperature=50.0, seed=i)
                )
            )
            for i in range(8)
        ]
        finishes = sink.wait_done(*handles)
        ended = [(h, f) for h, f in zip(handles, finishes, strict=True) if f.reason == "eos"]
        assert ended, "no request hit eos"
        h, f = ended[0]
        assert sink.tokens[h.id][-1] in running.model.tokenizer.eos_ids
        assert f.usage.completion_tokens == len(sink.tokens[h.id])
        assert eos in running.model.tokenizer.eos_ids
    finally:
        stop_engine(running)


def test_context_end_finishes_the_request(tiny_gguf: Path) -> None:
    running = start_engine(tiny_gguf, EngineConfig(max_batch=2, max_context=40, page_size=8))
    try:
        eng, sink = running.engine, running.sink
        with pytest.raises(RequestInvalid, match="exceeds the context window of 40"):
            eng.submit(GenerationRequest("c", _prompt(30), 11))
        h = eng.submit(GenerationRequest("c", _prompt(30), 10, ignore_eos=True))
        (f,) = sink.wait_done(h)
        assert f.reason in ("length", "context")
        assert f.usage.total_tokens <= 40
    finally:
        stop_engine(running)


def test_invalid_requests_are_refused_at_submit(tiny_engine: RunningEngine) -> None:
    eng = tiny_engine.engine
    with pytest.raises(RequestInvalid) as e:
        eng.submit(GenerationRequest("x", (), 5))
    assert e.value.param == "prompt"
    with pytest.raises(RequestInvalid):
        eng.submit(GenerationRequest("x", (10**6,), 5))
    with pytest.raises(RequestInvalid) as e:
        eng.submit(GenerationRequest("x", (5,), 0))
    assert e.value.param == "max_new_tokens"


def test_an_exception_fails_one_request_not_the_engine(
    tiny_engine: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, sink = tiny_engine.engine, tiny_engine.sink
    plant_sampling_failure(monkeypatch, "boom")
    bad = eng.submit(
        GenerationRequest("bad", _prompt(5), 5, SamplingParams(temperature=1.0, seed=FAILING_SEED))
    )
    (f,) = sink.wait_done(bad)
    assert f.reason == "error"
    assert f.error
    assert "boom" not in f.error
    good = eng.submit(GenerationRequest("good", _prompt(5), 5, ignore_eos=True))
    (g,) = sink.wait_done(good)
    assert g.reason == "length"
    assert eng.statistics().pages_used == 0


def test_events_leave_once_per_step(tiny_engine: RunningEngine) -> None:
    """Sixteen requests decoding together: deliveries are per step (at most two: the
    first tokens of the prompts it prefilled, then its decode step's), not per token."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    handles = [
        eng.submit(GenerationRequest(f"b{i}", _prompt(3, i), 20, ignore_eos=True))
        for i in range(16)
    ]
    sink.wait_done(*handles)
    tokens = sum(len(sink.tokens[h.id]) for h in handles)
    assert tokens == 16 * 20
    assert sink.batches <= 2 * eng.statistics().steps + 1
    assert sink.batches < tokens / 4


def test_a_step_s_tokens_go_out_as_the_next_pass_starts(tiny_engine: RunningEngine) -> None:
    """On the native layers a step's events are delivered as the next pass starts, from
    inside it (the event loop's work on them then overlaps the pass: docs/engine.md):
    each pass finds every token before it delivered, and the last token, which no pass
    follows, is delivered as the engine goes idle."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    assert eng.model is not None
    native = eng.model.transformer.native
    if native is None:
        pytest.skip("the native kernels are not built here")
    in_pass = [False]
    seen: list[int] = []  # tokens delivered as each pass's computation began
    deliveries: list[tuple[bool, int]] = []  # (from inside a pass, tokens delivered)
    forward, impl, deliver = native.forward, native._impl, sink.deliver

    def in_a_pass(*args: Any, **kwargs: Any) -> Any:
        in_pass[0] = True
        try:
            return forward(*args, **kwargs)
        finally:
            in_pass[0] = False

    class Recording:
        def forward(self, *args: Any) -> Any:
            with sink.cv:
                seen.append(sum(len(t) for t in sink.tokens.values()))
            return impl.forward(*args)

    def recording(events: list[Any]) -> None:
        tokens = sum(len(e.token_ids) for _, e in events if isinstance(e, TokenDelta))
        deliveries.append((in_pass[0], tokens))
        deliver(events)

    native.forward, native._impl, sink.deliver = in_a_pass, Recording(), recording  # type: ignore[method-assign]
    try:
        handle = eng.submit(GenerationRequest("p", _prompt(6), 12, ignore_eos=True))
        sink.wait_done(handle)
    finally:
        native.forward, native._impl, sink.deliver = forward, impl, deliver  # type: ignore[method-assign]
    assert len(sink.tokens[handle.id]) == 12
    # One pass a token (the prompt's, then eleven decode steps), each after the tokens
    # before it went out; each of those went out from inside the pass after it.
    assert seen == list(range(12))
    assert deliveries == [(True, 1)] * 11 + [(False, 1)]


def test_admitting_a_request_holds_no_made_token_back(tiny_engine: RunningEngine) -> None:
    """A request arriving while another decodes is admitted only after every token made
    so far went out: delivering at the next pass's start (above) must not make a stream
    wait for another request's admission."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    first = eng.submit(GenerationRequest("a", _prompt(6), 40, ignore_eos=True))
    sink.wait_for(lambda: len(sink.tokens.get(first.id, ())) >= 3)
    checks: list[tuple[int, int]] = []  # (tokens delivered, tokens made) at admission
    admit = eng._admit

    def recording(handle: RequestHandle, request: GenerationRequest, submitted: float) -> None:
        with sink.cv:
            delivered = sum(len(t) for t in sink.tokens.values())
        checks.append((delivered, eng._counters.generated))
        admit(handle, request, submitted)

    eng._admit = recording  # type: ignore[method-assign]
    try:
        second = eng.submit(GenerationRequest("b", _prompt(5, 1), 5, ignore_eos=True))
        sink.wait_done(first, second)
    finally:
        eng._admit = admit  # type: ignore[method-assign]
    assert len(checks) == 1
    delivered, made = checks[0]
    assert made >= 3
    assert delivered == made


def test_a_paused_request_waits_and_then_gets_its_own_tokens(tiny_engine: RunningEngine) -> None:
    """Pausing (for a reader far behind) leaves a request out of decode steps without
    losing its place: resumed, it finishes with exactly the tokens it gets unpaused."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    seeded = SamplingParams(temperature=0.9, seed=7)
    alone = eng.submit(GenerationRequest("alone", _prompt(10), 30, seeded, ignore_eos=True))
    sink.wait_done(alone)
    paused = eng.submit(GenerationRequest("paused", _prompt(10), 30, seeded, ignore_eos=True))
    eng.pause(paused, True)
    sink.wait_for(lambda: len(sink.tokens.get(paused.id, [])) >= 1)  # prefill's token
    held = len(sink.tokens[paused.id])
    other = eng.submit(GenerationRequest("other", _prompt(6, 1), 40, ignore_eos=True))
    sink.wait_done(other)
    assert len(sink.tokens[paused.id]) == held, "decoded while paused"
    assert eng.statistics().decoding == 1
    eng.pause(paused, False)
    sink.wait_done(paused)
    assert sink.tokens[paused.id] == sink.tokens[alone.id]


def _alone(path: Path, request: GenerationRequest) -> list[int]:
    """The request's tokens from a fresh engine: nothing cached, nothing shared."""
    running = start_engine(
        path, EngineConfig(max_batch=16, kv_capacity=4096, page_size=16, prefill_chunk=8)
    )
    try:
        h = running.engine.submit(request)
        running.sink.wait_done(h)
        return running.sink.tokens[h.id]
    finally:
        stop_engine(running)


def test_waiting_prompts_are_prefilled_together_with_the_tokens_each_gets_alone(
    tmp_path: Path,
) -> None:
    """With every layer matrix in the int4 kernel (a Q4 model), prompts waiting together
    are prefilled in one pass, as many as --prefill-chunk holds whole, in order: each
    gets exactly the tokens it gets alone from a fresh engine whose prefill chunks are
    another size (8 tokens), greedy and seeded."""
    from tinymodel import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "packed.gguf", packed_layers=True)
    config = EngineConfig(max_batch=16, kv_capacity=4096, page_size=16, prefill_chunk=64)
    running = start_engine(path, config)
    try:
        eng, sink = running.engine, running.sink
        assert eng.served().prefill_together_rows == 64
        seeded = [SamplingParams(), SamplingParams(temperature=0.9, seed=5)]
        reqs = [
            GenerationRequest(f"t{i}", _prompt(3 + 7 * i, i), 12, seeded[i % 2], ignore_eos=True)
            for i in range(6)
        ]  # prompts of 3, 10, 17, 24, 31 and 38 tokens
        # Hold the engine in a delivery while all six wait, so that they are waiting
        # together when its loop next looks.
        sink.open.clear()
        blocker = eng.submit(GenerationRequest("blocker", _prompt(4, 9), 2, ignore_eos=True))
        assert sink.holding.wait(HANG_GUARD_S)
        passes = eng.statistics().prefill_passes
        handles = [eng.submit(r) for r in reqs]
        sink.open.set()
        sink.wait_done(blocker, *handles)
        # 3 + 10 + 17 + 24 fit in 64; then 31 (38 more would not fit); then 38.
        assert eng.statistics().prefill_passes - passes == 3
        together = [sink.tokens[h.id] for h in handles]
    finally:
        stop_engine(running)
    assert together == [_alone(path, r) for r in reqs]


def test_a_prompt_beside_streams_shares_their_decode_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where prompts are prefilled together (a Q4 model: its layer matrices compute a row
    the same in any number of rows), a prompt arriving while others decode is computed in
    their decode steps' passes, a chunk a step, its first token sampled in the pass of its
    last chunk; no pass of its own. Every request, the streams too, gets exactly the
    tokens it gets alone."""
    from ninfer.engine import _engine

    path = write_tiny_gguf(tmp_path / "packed.gguf", packed_layers=True)
    config = EngineConfig(max_batch=4, kv_capacity=4096, page_size=16, prefill_chunk=64)
    mixed: list[tuple[int, list[int]]] = []  # each mixed pass: its decode rows, its chunks
    alone: list[list[int]] = []  # each prompt pass of its own: its chunks
    real_mixed, real_pass = _engine.Engine._mixed_step, _engine.Engine._prefill_pass

    def mixed_step(self: Any, rows: list[Any], group: list[Any], sizes: list[int]) -> None:
        mixed.append((len(rows), list(sizes)))
        real_mixed(self, rows, group, sizes)

    def prefill_pass(self: Any, group: list[Any], sizes: list[int]) -> None:
        alone.append(list(sizes))
        real_pass(self, group, sizes)

    monkeypatch.setattr(_engine.Engine, "_mixed_step", mixed_step)
    monkeypatch.setattr(_engine.Engine, "_prefill_pass", prefill_pass)
    streams = [
        GenerationRequest("s0", _prompt(6, 1), 80, ignore_eos=True),
        GenerationRequest("s1", _prompt(9, 2), 80, SamplingParams(temperature=0.9, seed=3),
                          ignore_eos=True),
    ]  # fmt: skip
    prompts = [
        GenerationRequest("long", _prompt(150, 3), 6, SamplingParams(temperature=0.8, seed=4)),
        GenerationRequest("short", _prompt(12, 4), 6, ignore_eos=True),
    ]
    running = start_engine(path, config)
    try:
        eng, sink = running.engine, running.sink
        assert eng.served().prefill_together_rows == 64
        handles = []
        for r in streams:
            handles.append(eng.submit(r))
            sink.wait_for(lambda h=handles[-1]: len(sink.tokens.get(h.id, [])) >= 2)  # type: ignore[misc]
        passes_before = len(alone)
        handles += [eng.submit(r) for r in prompts]
        sink.wait_done(*handles)
        got = [sink.tokens[h.id] for h in handles]
    finally:
        stop_engine(running)
    # every prompt after the first stream's went with the streams' steps (the second
    # stream's too), the long one's 150 tokens in chunks of at most 64 less their rows
    assert len(alone) == passes_before == 1, alone
    assert sum(sum(sizes) for _, sizes in mixed) == 9 + 150 + 12, mixed
    assert all(rows >= 1 and rows + sum(sizes) <= 64 for rows, sizes in mixed), mixed
    assert len(mixed) >= 3
    assert got == [_alone(path, r) for r in [*streams, *prompts]]


def test_shared_prompt_pages_give_the_same_tokens(
    tiny_gguf: Path, tiny_engine: RunningEngine
) -> None:
    """A prompt whose pages are in the prefix cache skips computing them and still gets
    exactly the tokens it gets computed from scratch: whole pages, then the first tokens
    of its next page, copied from a cached page that goes on as the prompt does. The
    pages are held once per request and come back when both are done."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    total = eng.statistics().pages_total
    base = _prompt(50)  # three full pages and two tokens
    fork = (*base[:40], 7, 7, 7)  # two pages in common, then it differs

    def req(name: str, prompt: tuple[int, ...]) -> GenerationRequest:
        return GenerationRequest(name, prompt, 20, SamplingParams(temperature=0.8, seed=3),
                                 ignore_eos=True)  # fmt: skip

    first = eng.submit(req("first", base))
    (f1,) = sink.wait_done(first)
    assert f1.usage.cached_tokens == 0
    again = eng.submit(req("again", base))
    forked = eng.submit(req("forked", fork))
    f2, f3 = sink.wait_done(again, forked)
    # `again`: three pages, then one token of the fourth (which the first request's
    # output filled; the last prompt token is always computed). `forked`: two pages,
    # then eight tokens of the third.
    assert (f2.usage.cached_tokens, f3.usage.cached_tokens) == (49, 40)
    assert sink.tokens[again.id] == sink.tokens[first.id] == _alone(tiny_gguf, req("b", base))
    assert sink.tokens[forked.id] == _alone(tiny_gguf, req("f", fork))
    stats = eng.statistics()
    assert stats.cached_prompt_tokens == 49 + 40
    assert stats.pages_free == total  # cached pages nobody holds count as free


def test_a_next_turn_reuses_the_pages_the_last_answer_filled(
    tiny_gguf: Path, tiny_engine: RunningEngine
) -> None:
    """A finished request's output pages join the prefix cache: a prompt that goes on
    from its prompt and answer (a conversation's next turn) computes only what follows
    the answer's last full page, and gets the tokens it gets from scratch."""
    eng, sink = tiny_engine.engine, tiny_engine.sink
    sampling = SamplingParams(temperature=0.8, seed=11)
    first = eng.submit(GenerationRequest("turn1", _prompt(30, 4), 19, sampling, ignore_eos=True))
    sink.wait_done(first)
    # Its keys and values cover the prompt and all but the last output token: 48 of
    # them, three full pages.
    turn2 = (*_prompt(30, 4), *sink.tokens[first.id], 5, 6, 7)
    second = eng.submit(GenerationRequest("turn2", turn2, 12, sampling, ignore_eos=True))
    (f2,) = sink.wait_done(second)
    assert f2.usage.cached_tokens == 48
    alone = _alone(tiny_gguf, GenerationRequest("b", turn2, 12, sampling, ignore_eos=True))
    assert sink.tokens[second.id] == alone


def test_the_prefix_cache_under_churn_loses_no_page_and_changes_no_token(
    tmp_path: Path,
) -> None:
    """Prompts drawn from a few shared prefixes (whole pages, parts of pages, answers'
    pages), some cancelled while they wait or run, some asking for prompt logprobs,
    through a pool that must reclaim cached pages: nothing fails, every page is free
    at the end, and on a model whose matrices all run through the int4 kernel the
    requests served from the cache get the tokens an engine without it computes."""
    import random

    from tinymodel import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "packed.gguf", packed_layers=True)
    config = EngineConfig(max_batch=6, kv_capacity=640, page_size=16, prefill_chunk=24)
    rng = random.Random(7)
    bases = [tuple(rng.randrange(3, 12) for _ in range(70)) for _ in range(3)]
    running = start_engine(path, config)
    try:
        eng, sink = running.engine, running.sink
        reqs: list[GenerationRequest] = []
        handles: list[RequestHandle] = []
        for i in range(60):
            # Waited for below and never cancelled: their answers are whole and known.
            done = [j for j in range(len(handles) - len(handles) % 10) if j % 7 != 3]
            if i % 5 == 4 and done:  # a next turn: a request's prompt and answer, and more
                j = done[rng.randrange(len(done))]
                prompt = (*reqs[j].prompt_ids, *sink.tokens[handles[j].id])
            else:
                prompt = rng.choice(bases)[: rng.randrange(1, 70)]
            prompt = (*prompt, *(rng.randrange(3, 12) for _ in range(rng.randrange(1, 6))))
            sampling = SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams()
            reqs.append(GenerationRequest(f"c{i}", prompt[-200:], rng.randrange(1, 20), sampling,
                                          ignore_eos=True,
                                          prompt_logprobs=2 if i % 17 == 0 else None))  # fmt: skip
            handles.append(eng.submit(reqs[-1]))
            if i % 7 == 3:
                eng.cancel(handles[-1])
            if i % 10 == 9:  # a few at a time: the pool fills, and cached pages go
                sink.wait_done(*handles[-10:])
        finishes = sink.wait_done(*handles)
        stats = eng.statistics()
    finally:
        stop_engine(running)
    assert {f.reason for f in finishes} <= {"length", "cancelled"}
    assert stats.pages_free == stats.pages_total
    assert stats.cached_prompt_tokens > 0
    served = [
        (req, sink.tokens.get(h.id))
        for req, h, f in zip(reqs, handles, finishes, strict=True)
        if f.reason == "length" and f.usage.cached_tokens > 0
    ]
    assert len(served) >= 20
    fresh = start_engine(path, attrs.evolve(config, prefix_cache=False))
    try:
        for req, tokens in served[::4]:
            h = fresh.engine.submit(req)
            fresh.sink.wait_done(h)
            assert fresh.sink.tokens[h.id] == tokens, req.request_id
    finally:
        stop_engine(fresh)


def test_without_the_prefix_cache_every_prompt_is_computed_whole(tmp_path: Path) -> None:
    from tinymodel import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = EngineConfig(max_batch=4, kv_capacity=1024, page_size=16, prefix_cache=False)
    running = start_engine(path, config)
    try:
        eng, sink = running.engine, running.sink
        req = GenerationRequest("same", _prompt(40), 8, ignore_eos=True)
        finishes = [sink.wait_done(eng.submit(req))[0] for _ in range(2)]
        assert [f.usage.cached_tokens for f in finishes] == [0, 0]
        assert eng.statistics().pages_cached == 0
    finally:
        stop_engine(running)


def _hold_forward(
    running: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Make the model's forward pass wait: (entered, release). It sets `entered` when a
    pass begins, and runs it once `release` is set."""
    cls = type(running.model.transformer)
    real_forward = cls.forward
    entered, release = threading.Event(), threading.Event()

    def held(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(HANG_GUARD_S)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", held)
    return entered, release


def test_waiting_for_work_is_not_a_stall(
    tiny_engine: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's progress clock restarts when work arrives after an idle wait: while
    its first step runs, the last progress is no older than the request (before, it was
    the moment the wait began, and a step after 30 s idle read as a stall)."""
    import time

    eng = tiny_engine.engine
    entered, release = _hold_forward(tiny_engine, monkeypatch)
    submitted = time.monotonic()
    handle = eng.submit(GenerationRequest("after-idle", _prompt(3), 2))
    assert entered.wait(HANG_GUARD_S)
    stats = eng.statistics()
    release.set()
    tiny_engine.sink.wait_done(handle)
    assert stats.busy
    assert stats.last_progress >= submitted


def test_a_slow_engine_is_not_a_stalled_one(
    tiny_engine: RunningEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine reports its slowest recent step (a step held here is counted at least
    as long as it was held), and a stall is judged against it: on a machine where steps
    take 5 s, 35 s without a step is slowness (a fixed 30 s called it a stall and
    refused every request); 10 steps' worth is a stall, and so is 30 s of a fast
    engine."""
    import time

    from ninfer._bridge import STALL_FACTOR, STALL_FLOOR_S, is_stalled

    eng = tiny_engine.engine
    entered, release = _hold_forward(tiny_engine, monkeypatch)
    handle = eng.submit(GenerationRequest("held", _prompt(3), 2))
    assert entered.wait(HANG_GUARD_S)
    began = time.monotonic()
    while time.monotonic() - began < 0.05:  # hold the step for a measurable time
        pass
    release.set()
    tiny_engine.sink.wait_done(handle)
    stats = eng.statistics()
    assert stats.slowest_recent_step >= 0.05

    slow = attrs.evolve(stats, busy=True, last_progress=0.0, slowest_recent_step=5.0)
    assert not is_stalled(slow, 35.0)
    assert is_stalled(slow, STALL_FACTOR * 5.0 + 0.1)
    fast = attrs.evolve(slow, slowest_recent_step=0.02)
    assert not is_stalled(fast, STALL_FLOOR_S - 0.1)
    assert is_stalled(fast, STALL_FLOOR_S + 0.1)
    assert not is_stalled(attrs.evolve(fast, busy=False), 3600.0)


def test_output_past_its_reservation_grows_into_free_pages_or_ends(tiny_gguf: Path) -> None:
    """A request that reserved less than its budget (a clamped OpenAI or Anthropic one)
    grows into free pages, with the same tokens as fully reserved; when no page is
    free it ends with `capacity` instead of waiting."""
    running = start_engine(
        tiny_gguf, EngineConfig(max_batch=4, kv_capacity=128, page_size=16, prefill_chunk=8)
    )  # a pool of 8 pages
    eng, sink = running.engine, running.sink
    try:
        full = GenerationRequest("full", _prompt(10), 100, ignore_eos=True)
        grown = GenerationRequest("grown", _prompt(10), 100, ignore_eos=True, reserve_tokens=6)
        a, b = eng.submit(full), None
        sink.wait_done(a)
        b = eng.submit(grown)
        (done,) = sink.wait_done(b)
        assert done.reason == "length"
        assert sink.tokens[b.id] == sink.tokens[a.id]
        assert eng.statistics().pages_used == 0
        # One page reserved, paused after its first token; then a request takes the
        # other seven pages and pauses too: resumed, the first has no page to grow into.
        small, big = crowd_out(running, _prompt(10), _prompt(10, 1))
        eng.pause(small, False)
        (ended,) = sink.wait_done(small)
        assert ended.reason == "capacity"
        # Its page holds positions 10..15; the token sampled from position 15 is its last.
        assert ended.usage.completion_tokens == 16 - 10 + 1
        eng.pause(big, False)
        assert sink.wait_done(big)[0].reason == "length"
    finally:
        stop_engine(running)


def test_engine_diagnostics_go_to_stderr_never_stdout(
    tiny_gguf: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An engine given no logger of the server's (a program using it directly, as the
    fidelity test's subprocess does) writes its diagnostics to stderr: its stdout is
    the program's own. bfloat16 activations always log `batching_not_invariant` (and
    they serve: that mode's attention once met bfloat16 keys with float32 queries)."""
    running = start_engine(tiny_gguf, EngineConfig(dtype="bfloat16", max_batch=2))
    try:
        h = running.engine.submit(GenerationRequest("bf16", _prompt(9), 6))
        (fin,) = running.sink.wait_done(h)
        assert fin.reason == "length"
    finally:
        stop_engine(running)
    out, err = capfd.readouterr()
    assert "batching_not_invariant" in err
    assert out == ""


def test_scoring_a_prompt_yields_to_the_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whose tokens are scored (prompt logprobs, echo) is background work: while
    another request decodes, its passes come at most once every SCORE_EVERY decode steps
    (an 880-token echo held a running stream's median gap at 608 ms instead of 15), and
    its numbers are those it gets alone."""
    from ninfer.engine import _engine

    path = write_tiny_gguf(tmp_path / "long.gguf", context=4096)
    prompt = _prompt(600, salt=5)
    config = EngineConfig(max_batch=4, kv_capacity=8192, page_size=16, prefill_chunk=64)
    scored = GenerationRequest("scored", prompt, 1, prompt_logprobs=1)

    def prompt_logprobs(running: RunningEngine, handle: RequestHandle) -> list[Any]:
        events = [e for h, e in running.sink.events if h.id == handle.id]
        return [e.prompt_logprobs for e in events if isinstance(e, TokenDelta)]

    running = start_engine(path, config)
    try:
        alone = running.engine.submit(scored)
        running.sink.wait_done(alone)
        expected = prompt_logprobs(running, alone)
    finally:
        stop_engine(running)
    steps: list[str] = []  # "p": a scoring pass, "d": a decode step with the stream
    real_pass, real_step = _engine.Engine._prefill_pass, _engine.Engine._decode_step

    def prefill_pass(self: Any, group: list[Any], sizes: list[int]) -> None:
        if any(a.request.prompt_logprobs is not None for a in group):
            steps.append("p")
        real_pass(self, group, sizes)

    def decode_step(self: Any, *prompts: Any) -> None:
        if any(a.request.request_id == "stream" for a in self._decoding):
            steps.append("d")
        real_step(self, *prompts)

    monkeypatch.setattr(_engine.Engine, "_prefill_pass", prefill_pass)
    monkeypatch.setattr(_engine.Engine, "_decode_step", decode_step)
    running = start_engine(path, config)
    try:
        stream = running.engine.submit(
            GenerationRequest("stream", _prompt(8), 2000, ignore_eos=True)
        )
        running.sink.wait_for(lambda: len(running.sink.tokens.get(stream.id, ())) >= 2)
        handle = running.engine.submit(scored)
        running.sink.wait_done(handle)
        got = prompt_logprobs(running, handle)
        running.engine.cancel(stream)
        running.sink.wait_done(stream)
    finally:
        stop_engine(running)
    passes = "".join(steps).split("p")[1:-1]  # the decode steps between scoring passes
    assert len(passes) >= 2, steps
    assert all(len(between) >= _engine.SCORE_EVERY for between in passes), "".join(steps)
    assert got == expected


def test_a_prompt_beside_streams_is_prefilled_in_passes_of_the_time_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another request decodes, a prefill pass is cut to what STREAM_PASS_S buys at
    the measured seconds a cost unit (here fixed: 40 units), so the stream's next token
    waits for about that long, not a whole --prefill-chunk; alone, the same prompt gets
    whole chunks. The prompt's tokens are the same either way. (Its chunks beside the
    stream go in the stream's decode steps where the model prefills prompts together:
    counted the same.)"""
    from ninfer.engine import _engine

    path = write_tiny_gguf(tmp_path / "budget.gguf", context=2048)
    prompt = _prompt(300, salt=5)
    config = EngineConfig(max_batch=4, kv_capacity=2048, page_size=16, prefill_chunk=64)
    monkeypatch.setattr(_engine.Counters, "unit_rate", lambda _self: _engine.STREAM_PASS_S / 40)
    real, real_mixed = _engine.Engine._prefill_pass, _engine.Engine._mixed_step

    def run(beside: bool) -> tuple[list[tuple[int, float]], list[int]]:
        """(tokens, cost in units) of each pass over the long prompt, and its greedy
        tokens."""
        costs: list[tuple[int, float]] = []

        def count(self: Any, group: list[Any], sizes: list[int]) -> None:
            keys = self._p.keys_per_token
            costs.extend((size, size * (1 + a.prefilled / keys))
                         for a, size in zip(group, sizes, strict=True)
                         if a.request.request_id == "long")  # fmt: skip

        def counted(self: Any, group: list[Any], sizes: list[int]) -> None:
            count(self, group, sizes)
            real(self, group, sizes)

        def mixed(self: Any, rows: list[Any], group: list[Any], sizes: list[int]) -> None:
            count(self, group, sizes)
            real_mixed(self, rows, group, sizes)

        monkeypatch.setattr(_engine.Engine, "_prefill_pass", counted)
        monkeypatch.setattr(_engine.Engine, "_mixed_step", mixed)
        running = start_engine(path, config)
        try:
            stream = None
            if beside:
                stream = running.engine.submit(
                    GenerationRequest("stream", _prompt(8), 1500, ignore_eos=True)
                )
                running.sink.wait_for(lambda: len(running.sink.tokens.get(stream.id, ())) >= 2)
            handle = running.engine.submit(GenerationRequest("long", prompt, 4))
            running.sink.wait_done(handle)
            if stream is not None:
                running.engine.cancel(stream)
                running.sink.wait_done(stream)
        finally:
            stop_engine(running)
        return costs, running.sink.tokens[handle.id]

    beside, tokens = run(beside=True)
    alone, tokens_alone = run(beside=False)
    assert tokens == tokens_alone
    assert alone[0][0] == 64  # a whole --prefill-chunk where nothing else decodes
    # beside the stream: the budget's cost, or MIN_DEEP_CHUNK tokens where it buys fewer
    assert beside[0][0] == 40
    assert all(c <= 40 + 1e-6 or t == _engine.MIN_DEEP_CHUNK for t, c in beside), beside
    assert len(beside) > len(alone)


def test_prefill_passes_shrink_with_depth_and_keep_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt is prefilled in passes of bounded cost: fewer tokens a pass the
    deeper it is (each pass holds up every running stream; on SmolLM2 a 256-token pass
    took 0.42 s at depth 0 and 1.8 s at depth 3,072). Every pass costs at most
    --prefill-chunk tokens at depth 0, and the prompt's greedy tokens and prompt
    logprobs are exactly those of passes of the full chunk."""
    from ninfer.engine import _engine, _startup
    from ninfer.engine._gguf import ModelArgs

    smollm2 = ModelArgs("llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, 1e5, 1e-5)
    # its matrices cost what 3,072 keys' attention does, by arithmetic
    assert _startup.keys_per_token(smollm2) == pytest.approx(
        3072 / _startup.ATTENTION_INEFFICIENCY, rel=1e-3
    )
    path = write_tiny_gguf(tmp_path / "long.gguf", context=4096)
    prompt = _prompt(900, salt=3)
    config = EngineConfig(max_batch=4, kv_capacity=2048, page_size=16, prefill_chunk=64)

    def run(shrink: bool) -> tuple[list[tuple[int, int]], list[int], list[Any], float]:
        """(depth, tokens) of each pass, the greedy tokens, the prompt logprobs, and the
        engine's keys per token."""
        if not shrink:
            monkeypatch.setattr(_startup, "keys_per_token", lambda _args: 1e12)
        passes: list[tuple[int, int]] = []
        real = _engine.Engine._prefill_pass

        def counted(self: Any, group: list[Any], sizes: list[int]) -> None:
            passes.extend((a.prefilled, size) for a, size in zip(group, sizes, strict=True))
            real(self, group, sizes)

        monkeypatch.setattr(_engine.Engine, "_prefill_pass", counted)
        running = start_engine(path, config)
        try:
            assert running.engine.plan is not None
            keys = running.engine.plan.keys_per_token
            handle = running.engine.submit(GenerationRequest("long", prompt, 6, prompt_logprobs=2))
            running.sink.wait_done(handle)
        finally:
            stop_engine(running)
            monkeypatch.undo()
        mine = [e for h, e in running.sink.events if h.id == handle.id]
        lps = [e.prompt_logprobs for e in mine if isinstance(e, TokenDelta) and e.prompt_logprobs]
        sized = [(d, min(t, len(prompt) - d)) for d, t in passes]
        return sized, running.sink.tokens[handle.id], lps, keys

    shrunk, tokens, lps, keys = run(shrink=True)
    whole, tokens_whole, lps_whole, _ = run(shrink=False)
    assert all(t * (1 + d / keys) <= 64 + 1e-6 or t <= _engine.MIN_DEEP_CHUNK for d, t in shrunk)
    assert shrunk[-1][1] < 64
    assert len(shrunk) > len(whole)
    assert lps
    assert tokens == tokens_whole
    assert lps == lps_whole


def test_the_budget_is_sized_by_the_passes_taken_beside_decoding() -> None:
    """The time budget of a pass beside decoding requests is applied with the seconds a
    cost unit of the recent passes taken beside them; a prompt's large passes alone (a
    lower rate: fewer passes' fixed costs, nothing else on the cores) do not move it.
    Before any such pass, every pass's rate."""
    from ninfer.engine._engine import PREFILL_RATE_MIN_TOKENS, Counters

    c = Counters()
    assert c.unit_rate() == 0.0
    c.add_prefill(512, 0.512, 0.0, 512.0)  # alone: 1 ms a unit
    assert c.unit_rate() == pytest.approx(0.001)
    c.add_prefill(64, 0.16, 0.0, 64.0, beside=True)  # beside: 2.5 ms a unit
    assert PREFILL_RATE_MIN_TOKENS <= 64
    assert c.unit_rate() == pytest.approx(0.0025)
    for _ in range(3):  # the prompt's passes once the stream has ended
        c.add_prefill(512, 0.512, 0.0, 512.0)
    assert c.unit_rate() == pytest.approx(0.0025)


def test_a_sliding_window_caps_what_a_deep_token_costs(tmp_path: Path) -> None:
    """A prompt token's cost grows with the keys it attends to, a layer on average: the
    whole row in a global layer, at most the window in a local one. Gemma 3's five local
    layers in six (window 512 in the 270M): at depth 8,000 a token attends to ~1,760 keys
    a layer, not 8,000 (which put its deep passes at ~4x their cost). A model without a
    window: the whole depth."""
    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3", n_layers=6,
                           sliding_window=512, context=16384)  # fmt: skip
    running = start_engine(path, EngineConfig(max_batch=2, kv_capacity=256, page_size=16))
    try:
        plan = running.engine.plan
    finally:
        stop_engine(running)
    assert (plan.window, plan.local_share) == (512, pytest.approx(5 / 6))
    assert plan.attended(100) == 100
    assert plan.attended(512) == 512
    assert plan.attended(8000) == pytest.approx(8000 / 6 + 512 * 5 / 6)
    plain = attrs.evolve(plan, window=0, local_share=0.0)
    assert plain.attended(8000) == 8000


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_prompts_pages_are_zeroed_before_any_pass_reads_them(
    tmp_path: Path, kernels: str
) -> None:
    """A prompt's fresh pages are zeroed pass by pass (the pages each chunk writes, its
    output's with the last chunk), not all as it is admitted. Pages full of NaN before it
    (memory a pool reuses holds anything) change nothing: a long prompt in many chunks,
    beside a stream that grows into new pages, gives the tokens of a clean pool."""
    path = write_tiny_gguf(tmp_path / "zero.gguf", context=2048)
    config = EngineConfig(max_batch=4, kv_capacity=1024, page_size=16, prefill_chunk=48,
                          kernels="torch" if kernels == "torch" else "auto")  # fmt: skip

    def run(poison: bool) -> tuple[list[int], list[int]]:
        running = start_engine(path, config)
        try:
            kv = running.engine._cache
            if poison:  # every page but the padding and scratch ones (zeroed for good)
                pages = torch.arange(1, kv.scratch_page)
                with torch.inference_mode():  # the pool is the engine's inference tensor
                    for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
                        if t is not None:
                            t.index_fill_(1, pages, float("nan"))
            stream = running.engine.submit(GenerationRequest("s", _prompt(5, salt=1), 40))
            running.sink.wait_for(lambda: len(running.sink.tokens.get(stream.id, ())) >= 1)
            long = running.engine.submit(GenerationRequest("l", _prompt(200, salt=2), 24))
            running.sink.wait_done(long)
            running.sink.wait_done(stream)
        finally:
            stop_engine(running)
        return running.sink.tokens[stream.id], running.sink.tokens[long.id]

    assert run(poison=True) == run(poison=False)
