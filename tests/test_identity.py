"""A request's tokens depend on nothing but the request, beside busy neighbours too: the
short version of benchmarks/identity.py, on the tiny model over a real socket. Greedy
answers to fixed prompts, taken alone on a quiet server, are taken again while a busy
process keeps each core busy and eight clients mix sampled requests among them (other
rows in the decode steps, other prompts prefilled between, the kernels' threads taken
off their cores); every one must be the same, token for token. The verdict is on the
tokens alone: how long it takes is the machine's business."""

from __future__ import annotations

import os
from pathlib import Path

from server import serve

from ninfer.tools._identity import busy_processes, loaded, prompts, reference


async def test_greedy_answers_beside_busy_neighbours_are_the_quiet_ones(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    texts = [t.replace("<|im_start|>", "").replace("<|im_end|>", "") for t in prompts(12)]
    async with serve(tiny_gguf, tmp_path, max_concurrency=8) as srv:
        want = await reference(srv.url, texts, 24)
        assert all(want)  # answers to compare
        with busy_processes(os.cpu_count() or 1):
            outcome = await loaded(
                srv.url, texts, want, answers=150, clients=8, max_tokens=24, greedy_share=0.6
            )
    assert outcome.compared >= 150
    assert outcome.sampled > 0
    assert outcome.differed == 0, outcome.first_differences
