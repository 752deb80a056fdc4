"""Grammar engines for constrained decoding, measured on ninfer's own vocabularies.

    .venv/bin/python benchmarks/grammar.py [--model smollm2-135m-instruct] [--model gemma3-270m]

For each engine that is installed (llguidance, xgrammar) and each model's vocabulary
(the token bytes ninfer streams, its EOS ids): the time to build the engine's
tokenizer, to compile a typical tool schema, and, over a valid answer tokenized by
ninfer, the time to compute one row's token mask and advance it, at batch 1 and at
batch 8 (eight rows in the same state, masks filled one after another as the engine
thread would), the same for ninfer's tool-call grammars (`auto` answered with text
and with a call, `required`), plus the time to apply a bitmask to a batch of float32
logits in torch.
Not part of the test suite; the figures are in docs/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ninfer._artifacts import cache_dir, resolve_model
from ninfer.engine._gguf_reader import read_gguf
from ninfer.engine._grammar import GrammarVocabulary, grammar_tokenizer
from ninfer.engine._tokenizer import tokenizer_from_metadata

# A get_weather-style tool's arguments, as agent frameworks send them (strict mode).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "details": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}, "lang": {"type": "string"}},
            "required": ["hourly", "lang"],
            "additionalProperties": False,
        },
    },
    "required": ["location", "unit", "days", "include", "details"],
    "additionalProperties": False,
}
ANSWER = json.dumps({
    "location": "Paris, France", "unit": "celsius", "days": 3,
    "include": ["wind", "humidity"], "details": {"hourly": False, "lang": "fr"},
})  # fmt: skip


def _ms(f: Callable[[], object], repeat: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - t) / repeat * 1e3


def bench_llguidance(vocab: GrammarVocabulary, answer: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch as lltorch

    out: dict[str, float] = {}
    t = time.perf_counter()
    lltok = grammar_tokenizer(vocab, len(vocab.tokens))
    out["tokenizer_ms"] = (time.perf_counter() - t) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(TOOL_SCHEMA)
    out["compile_ms"] = _ms(lambda: llguidance.LLMatcher(lltok, grammar), 5)
    for batch in (1, 8):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        mask = lltorch.allocate_token_bitmask(batch, len(vocab.tokens))
        per_step = []
        for token in answer:
            t = time.perf_counter()
            for i, m in enumerate(matchers):
                lltorch.fill_next_token_bitmask(m, mask, i)
                assert m.consume_token(token), m.get_error()
            per_step.append((time.perf_counter() - t) * 1e3)
        assert all(not m.is_error() for m in matchers)
        out[f"step_ms_b{batch}_median"] = statistics.median(per_step)
        out[f"step_ms_b{batch}_max"] = max(per_step)
    return out


def bench_xgrammar(vocab: GrammarVocabulary, answer: list[int]) -> dict[str, float]:
    import xgrammar

    out: dict[str, float] = {}
    t = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        vocab.tokens, vocab_type=xgrammar.VocabType.RAW, vocab_size=len(vocab.tokens),
        stop_token_ids=vocab.special_token_ids,
    )  # fmt: skip
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    out["tokenizer_ms"] = (time.perf_counter() - t) * 1e3
    schema = json.dumps(TOOL_SCHEMA)
    out["compile_ms"] = _ms(lambda: compiler.compile_json_schema(schema), 3)
    compiled = compiler.compile_json_schema(schema)
    for batch in (1, 8):
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        mask = xgrammar.allocate_token_bitmask(batch, len(vocab.tokens))
        per_step = []
        for token in answer:
            t = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
                assert m.accept_token(token)
            per_step.append((time.perf_counter() - t) * 1e3)
        out[f"step_ms_b{batch}_median"] = statistics.median(per_step)
        out[f"step_ms_b{batch}_max"] = max(per_step)
    return out


TEXT_ANSWER = (
    "The weather in Paris is mild this week: expect light rain on Tuesday, then clear "
    "skies and temperatures between twelve and eighteen degrees until the weekend."
)


def bench_tools(vocab: GrammarVocabulary) -> dict[str, float]:
    """ninfer's tool grammars (two tools: TOOL_SCHEMA's and a small one): compile time
    and the per-step mask + advance time at batch 1 over three answers — `auto`
    answered with text, `auto` answered with text then a call, `required` with a call."""
    import llguidance

    from ninfer.frontends._tools import Tool, ToolPlan, tool_grammar

    tools = (
        Tool("get_weather", "The forecast", TOOL_SCHEMA, "tools[0]"),
        Tool("get_time", None, {"type": "object", "properties": {"zone": {"type": "string"}},
                                "required": ["zone"]}, "tools[1]"),
    )  # fmt: skip
    lltok = grammar_tokenizer(vocab, len(vocab.tokens))
    call = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": json.loads(ANSWER)})
    call += "\n</tool_call>"
    out: dict[str, float] = {}
    words = torch.zeros((len(vocab.tokens) + 31) // 32, dtype=torch.int32)
    for label, choice, text in (
        ("auto_text", "auto", TEXT_ANSWER),
        ("auto_call", "auto", "Let me look that up.\n" + call),
        ("required", "required", call),
    ):
        plan = ToolPlan(tools, choice, parallel=True)  # type: ignore[arg-type]
        t = time.perf_counter()
        grammar = tool_grammar(plan, None, "")
        out[f"{label}_compile_ms"] = (time.perf_counter() - t) * 1e3
        matcher = llguidance.LLMatcher(lltok, grammar)
        per_step = []
        for token in [*vocab(text), vocab.eos_token_id]:
            t = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            assert matcher.consume_token(token), matcher.get_error()
            per_step.append((time.perf_counter() - t) * 1e3)
        out[f"{label}_step_ms_median"] = statistics.median(per_step)
        out[f"{label}_step_ms_max"] = max(per_step)
    return out


def bench_apply(vocab_size: int) -> dict[str, float]:
    """Masking a batch of float32 logits with a packed bitmask, in torch (engine-side)."""
    out = {}
    bits = torch.arange(32, dtype=torch.int32)
    for batch in (1, 8):
        logits = torch.randn(batch, vocab_size)
        words = (vocab_size + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32)

        def apply(mask: torch.Tensor = mask, logits: torch.Tensor = logits) -> None:
            rows = mask.shape[0]
            allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().view(rows, -1)[:, :vocab_size]
            logits.masked_fill_(~allowed, float("-inf"))

        out[f"apply_ms_b{batch}"] = _ms(apply, 20)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", action="append", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    for name in args.model or ["smollm2-135m-instruct", "gemma3-270m"]:
        md, _ = read_gguf(str(resolve_model(name, cache_dir(None, os.environ))))
        vocab = GrammarVocabulary.of(tokenizer_from_metadata(md))
        answer = [*vocab(ANSWER), vocab.eos_token_id]
        print(f"\n{name}: vocabulary {len(vocab.tokens)}, answer {len(answer)} tokens")
        for engine, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                figures = bench(vocab, answer)
            except ImportError as exc:
                print(f"  {engine}: not installed ({exc})")
                continue
            print(f"  {engine}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
        try:
            tools = bench_tools(vocab)
            print("  tool grammars (llguidance): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in tools.items()))  # fmt: skip
        except ImportError as exc:
            print(f"  tool grammars: llguidance not installed ({exc})")
        print(
            "  torch: "
            + ", ".join(f"{k} {v:.2f}" for k, v in bench_apply(len(vocab.tokens)).items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
