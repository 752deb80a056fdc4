"""Incremental text: whole characters only, stop strings never leak, even split across tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer.engine._loader import load_model
from ninfer.engine._textstream import TextStream
from ninfer.engine._tokenizer import TextTokenizer


def _tok(path: Path) -> TextTokenizer:
    return load_model(str(path), dtype=torch.float32, device="cpu", max_positions=8).tokenizer


def _stream(tok: TextTokenizer, text: str, stops: tuple[str, ...]) -> tuple[list[str], TextStream]:
    ts = TextStream(decode=tok.decode, stops=stops)
    deltas = []
    for i in tok.encode(text):
        ts.push(i)
        deltas.append(ts.take(final=False))
        if ts.stopped_at is not None:
            break
    deltas.append(ts.take(final=True))
    return deltas, ts


def test_emoji_split_across_tokens_never_yields_a_broken_character(tiny_gguf: Path) -> None:
    tok = _tok(tiny_gguf)
    text = "a 👩‍👩‍👧 b 日本"
    assert len(tok.encode("👩")) == 4  # one byte token per UTF-8 byte in the tiny vocabulary
    deltas, _ = _stream(tok, text, ())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_split_across_tokens(tiny_gguf: Path) -> None:
    tok = _tok(tiny_gguf)
    deltas, ts = _stream(tok, "hello world STOP here", ("STOP",))
    assert "".join(deltas) == "hello world "
    assert ts.stop_string == "STOP"
    assert not any("S" in d for d in deltas), "no delta shows part of the stop string"


def test_partial_stop_prefix_is_released_when_it_does_not_match(tiny_gguf: Path) -> None:
    tok = _tok(tiny_gguf)
    deltas, ts = _stream(tok, "a STAR is born", ("STOP",))
    assert ts.stopped_at is None
    assert "".join(deltas) == "a STAR is born"


def test_earliest_of_several_stops_wins(tiny_gguf: Path) -> None:
    tok = _tok(tiny_gguf)
    deltas, ts = _stream(tok, "one two three", ("three", "two"))
    assert "".join(deltas) == "one "
    assert ts.stop_string == "two"
