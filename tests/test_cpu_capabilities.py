"""The answers that matter hold on lesser CPUs too: the real-model answer tests, the
self-check and the float64-reference logits test run again in a subprocess under
each CPU capability torch can be held to, as an AVX2-only or a plain x86-64 machine
would dispatch them (the default server once answered in French on AVX2 CPUs while
the suite was green on AVX-512: issue 27). The native capability is the suite itself.
Under `default` (scalar code everywhere: every real-model start-up there takes
minutes of the suite) only what decides an answer runs again: the README's answer (its
engine's start-up runs the native kernels' whole self-check, which the test asserts),
torch's self-check and the float64 logits; the SDK's answer, the native self-check
run on its own (with speculation's) and the rest run under avx2.

ATEN_CPU_CAPABILITY holds ATen's own kernels (the int4 kernel, norms, softmax, ...)
to a capability, and ninfer's native kernels to their build for it (plain x86-64, AVX2);
ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS hold the two matmul libraries to the
same, so the whole process dispatches as that CPU would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.realmodel

CAPABILITIES = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "default": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}
TORCH_NAMES = {"avx2": "AVX2", "default": "DEFAULT"}

TESTS = [
    "tests/test_realmodel_engine.py::test_chatml_prompt_tokenizes_and_greedy_reply_is_paris",
    "tests/test_selfcheck.py::test_the_check_runs_on_the_real_default_model_within_its_tolerances",
    "tests/test_model.py::test_logits_equal_an_independent_float64_forward",
]
# Under avx2 only: the native self-check on its own (the README's answer's engine ran
# it at start-up under both), the SDK's answer over HTTP and the int4 head; the
# prefix-cache test (its 1,000-token prompts take minutes on ATen's scalar int4
# kernel); the fidelity test
# (HTTP batches and the prefix cache against the engine alone, bit for bit), which
# caught MKL's AVX2 kernel computing attention rows by the row count.
AVX2_TESTS = [
    "tests/test_selfcheck.py::test_the_native_check_runs_on_the_real_default_model_within_its_tolerances",
    "tests/test_openai.py::test_real_model_through_the_sync_openai_sdk",
    "tests/test_model.py::test_the_head_gives_float32_logits_in_int4_mode",
    "tests/test_realmodel_engine.py::test_the_prefix_cache_changes_no_bit_of_an_answer",
    "tests/test_fidelity.py::test_http_equals_the_engine_in_another_process",
    "tests/test_speculative.py::test_the_default_model_speculates_without_changing_a_token",
]

# A hang guard for a machine five times slower than the 2-core one this was sized on
# (the `default` run takes about a minute there).
HANG_GUARD_S = 1500

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_real_model_answers_hold_under_a_lesser_cpu_capability(
    capability: str, real_gguf: Path
) -> None:
    """The tests above pass in a process that dispatches as an AVX2-only (or a plain
    x86-64) CPU; torch confirms the capability it runs at."""
    import torch

    native = torch.backends.cpu.get_cpu_capability()
    if native == TORCH_NAMES[capability]:
        pytest.skip(f"this CPU dispatches at {native} natively: the suite itself ran these")
    env = {**os.environ, **CAPABILITIES[capability]}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == TORCH_NAMES[capability]
    tests = TESTS + (AVX2_TESTS if capability == "avx2" else [])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " failed" not in done.stdout
