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
