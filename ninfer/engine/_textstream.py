"""Incremental detokenization with stop strings.

Text leaves only in whole characters: a token that ends inside a UTF-8 sequence
(one emoji can span three tokens) is held until the character completes. Text
that could be the start of a stop string is held until it is known not to be;
a matched stop string ends the text just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


@attrs.define(eq=False)
class TextStream:
    decode: Callable[[Sequence[int]], str]
    stops: tuple[str, ...] = ()
    ids: list[int] = attrs.field(factory=list)
    text: str = ""  # all text decoded so far
    sent: int = 0  # characters of `text` already handed out
    stopped_at: int | None = None  # index in `text` where a stop string starts
    stop_string: str | None = None
    _prefix: int = 0
    _read: int = 0

    def push(self, token: int) -> None:
        """Add one generated token (before any stop string matched)."""
        self.ids.append(token)
        self._advance(final=False)

    def _advance(self, *, final: bool) -> None:
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith(_REPLACEMENT)):
            self.text += after[len(before) :]
            self._prefix = self._read
            self._read = len(self.ids)
        if self.stops and self.stopped_at is None:
            self._find_stop()

    def _find_stop(self) -> None:
        best: int | None = None
        for s in self.stops:
            i = self.text.find(s, self.sent)
            if i >= 0 and (best is None or i < best):
                best, self.stop_string = i, s
        self.stopped_at = best

    def take(self, *, final: bool) -> str:
        """The text now safe to hand out; with `final`, everything that is left."""
        if final and self.stopped_at is None:
            self._advance(final=True)
        if self.stopped_at is not None:
            end = self.stopped_at
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_suffix()
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _held_suffix(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = self.text[self.sent :]
        held = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(tail)), held, -1):
                if tail.endswith(s[:n]):
                    held = n
                    break
        return held

    @property
    def final_text(self) -> str:
        return self.text[: self.stopped_at] if self.stopped_at is not None else self.text
