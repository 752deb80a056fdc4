"""Run generation cases on the engine directly, one at a time, in this process; print the
prompt and output token ids as JSON. tests/test_fidelity.py runs it in a subprocess and
compares with what came over HTTP from a server batching the same cases together.

python tests/fidelity_engine.py MODEL.gguf CASES.json PREFILL_CHUNK [THREADS [KV_DTYPE]]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import structlog

from ninfer.engine import (
    EngineConfig,
    Event,
    Finish,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenDelta,
)
from ninfer.engine._runtime import configure_process, create_engine
from ninfer.frontends._sampling import BUILT_IN
from ninfer.frontends._structured import json_schema_grammar

HANG_GUARD_S = 300


class Sink:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.done: set[int] = set()

    def deliver(self, events: list[tuple[RequestHandle, Event]]) -> None:
        with self.cv:
            for handle, event in events:
                if isinstance(event, TokenDelta):
                    self.tokens.setdefault(handle.id, []).extend(event.token_ids)
                    self.logprobs.setdefault(handle.id, []).extend(
                        [lp.logprob, [list(t) for t in lp.top]] for lp in event.logprobs or ()
                    )
                elif isinstance(event, Finish):
                    self.done.add(handle.id)
            self.cv.notify_all()


def main() -> None:
    model_path, cases_path, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cases = orjson.loads(Path(cases_path).read_bytes())
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    sink = Sink()
    # The server's own start: the same kernels (native where built), so the same numbers.
    engine = create_engine(
        lambda: model_path,
        EngineConfig(
            max_batch=8,
            kv_capacity=8192,
            page_size=16,
            prefill_chunk=chunk,
            prefix_cache=False,
            kv_dtype=sys.argv[5] if len(sys.argv) > 5 else "auto",
            threads=threads,
        ),
        sink,
        log=structlog.wrap_logger(structlog.PrintLogger(sys.stderr)),  # stdout is the answer
        progress=lambda _m: None,
    )
    ready = threading.Event()

    def run() -> None:
        configure_process(threads=threads)  # on the engine's thread, as the server does
        engine.run(on_ready=lambda _m: ready.set())

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(HANG_GUARD_S)
    assert engine.model is not None
    tok = engine.model.tokenizer
    out = []
    for i, case in enumerate(cases):
        ids = tuple(tok.encode(case["prompt"]))
        schema = case.get("json_schema")
        # a field the case leaves out is the server's built-in default, as over HTTP
        sampling = SamplingParams(
            temperature=case["temperature"],
            top_p=case.get("top_p", BUILT_IN["top_p"]),
            top_k=case.get("top_k", BUILT_IN["top_k"]),
            min_p=case.get("min_p", BUILT_IN["min_p"]),
            seed=case.get("seed"),
            grammar=None if schema is None else json_schema_grammar(schema, param="json_schema"),
        )
        handle = engine.submit(
            GenerationRequest(
                f"case-{i}",
                ids,
                case["max_new_tokens"],
                sampling,
                (),
                True,
                logprobs=case.get("logprobs"),
            )
        )
        with sink.cv:
            assert sink.cv.wait_for(lambda h=handle.id: h in sink.done, timeout=HANG_GUARD_S)
        out.append(
            {
                "prompt_ids": list(ids),
                "token_ids": sink.tokens.get(handle.id, []),
                "logprobs": sink.logprobs.get(handle.id, []),
            }
        )
    engine.shutdown()
    thread.join(HANG_GUARD_S)
    sys.stdout.write(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
