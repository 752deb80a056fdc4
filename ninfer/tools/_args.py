"""Value types of the tools' command-line flags (argparse `type=`): each refuses a bad
value with a line that says what it takes."""

from __future__ import annotations

import argparse
from typing import TypeVar

__all__ = ["int_list", "non_negative_float", "positive_float", "positive_int", "rate_list"]

T = TypeVar("T", int, float)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v < 1 or v > 1024 for v in values):
        raise argparse.ArgumentTypeError("each value must be 1..1024")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not 0 < v <= 10000 for v in values):
        raise argparse.ArgumentTypeError("each rate must be in (0, 10000] per second")
    return values


def _number(text: str, kind: type[T], what: str) -> T:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be 0 or a positive number of seconds")
    return value
