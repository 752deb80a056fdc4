"""Strict JSON in: a malformed body is said as the parser saw it, never echoed."""

from __future__ import annotations

import pytest

from protocols import ApiError, loads


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{oops", "unexpected character, expected a string key at line 1 column 2"),
        (b'{"a": NaN}', "NaN and Infinity are not JSON numbers at line 1 column 7"),
        (b'{"a": -Infinity}', "NaN and Infinity are not JSON numbers"),
        (b'{"a": 1e999}', "a number out of range"),
        (b"[1,", "unexpected end of data"),
        (b"\xff", "invalid UTF-8 or a lone surrogate escape"),
        (b"[" * 2000, "nesting deeper than 1024 levels"),
    ],
)
def test_malformed_json_is_said_as_it_is(body: bytes, reason: str) -> None:
    """The parser's own reason (a fixed phrase, never the input); the NaN hint only for
    NaN and Infinity."""
    with pytest.raises(ApiError) as e:
        loads(body)
    assert e.value.kind == "malformed_json"
    assert reason in e.value.message
    assert "oops" not in e.value.message


def test_sse_frames_escape_what_splitlines_takes_for_a_line_end() -> None:
    """A generated text may hold NEL, U+2028 or U+2029, which JSON allows raw; httpx's
    `aiter_lines` (Python's splitlines) would cut the data line there and the client
    would read broken JSON (a bench run failed so on the random model). Each frame is
    one line, and decodes to the same value."""
    import attrs
    import orjson

    from protocols._dialect import Encoder

    @attrs.frozen
    class Chunk:
        text: str

    text = "a\u0085b\u2028c\u2029d é 日 \U0001f916"
    frame = Encoder().sse(Chunk(text), event="token")
    lines = frame.decode().splitlines()
    assert lines[:2] == ["event: token", lines[1]]
    assert len([ln for ln in lines if ln]) == 2
    assert orjson.loads(lines[1].removeprefix("data: ")) == {"text": text}
