"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import start_engine, stop_engine

from ninfer.engine import EngineConfig, GenerationRequest

pytestmark = pytest.mark.realmodel

FRANCE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]  # fmt: skip


def test_chatml_prompt_tokenizes_and_greedy_reply_is_paris(real_gguf: Path) -> None:
    """The ChatML prompt gives the 37 reference ids; the float32 greedy reply names Paris
    and stops at <|im_end|>."""
    running = start_engine(real_gguf, EngineConfig(max_batch=2, kv_capacity=1024))
    try:
        tok = running.model.tokenizer
        assert tok.chat_template is not None
        prompt = tok.chat_template.render(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        ids = tok.encode(prompt)
        assert ids == FRANCE_IDS
        assert {0, 2} <= tok.eos_ids
        h = running.engine.submit(GenerationRequest("paris", tuple(ids), 64))
        (fin,) = running.sink.wait_done(h)
        text = "".join(running.sink.text[h.id])
        assert text.startswith("The capital of France is Paris.")
        assert fin.reason == "eos"
        assert running.sink.tokens[h.id][-1] == 2  # <|im_end|>
        assert running.model.identity.sha256 == (
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        )
    finally:
        stop_engine(running)
