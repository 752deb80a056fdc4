"""Keeping client text from becoming control tokens in a chat prompt.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`, ...) around the
client's messages. Tokenized as one string, a message that contains the text
`<|im_end|>` would close its own turn and could open a fake system turn: the
tokenizer cannot tell which `<|im_end|>` the template wrote. So every string of the
conversation is escaped before the template sees it (each control token's text, and
the escape character itself, become private-use sequences that no control token
spells), the rendered prompt is split only at the control tokens left (the
template's), and the text between them is unescaped and tokenized with control
tokens not recognised: a client's `<|im_end|>` is the ten characters it typed.
llama.cpp tokenizes chat content the same way (`parse_special = false`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = ["ControlText"]

_ESC = "\ue000"  # a private-use character: never part of a control token's text
_END = "\ue001"
_UNESCAPE = re.compile(f"{_ESC}(?:({_ESC})|([0-9]+){_END})")


def _trie_pattern(texts: Sequence[str]) -> str:
    """A regular expression that finds, at the leftmost place, the longest of `texts`:
    their characters as a trie, each node trying its children before ending there. An
    alternation of the texts themselves did the same but tried each of them at every
    candidate place: Gemma 3's 6,249 control tokens all start with "<", and 100,000 "<"
    took 1.8 s to scan (now 2 ms)."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a text ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" not in node:
            return body
        return ("(?:" + body + ")?") if len(branches) == 1 else body + "?"

    return pattern(trie)


@attrs.frozen
class ControlText:
    """The texts of a vocabulary's control tokens, and the escaping that keeps client
    text from spelling one."""

    texts: tuple[str, ...]  # control token texts, longest first
    ids: Mapping[str, int]
    _find: re.Pattern[str] | None = attrs.field(alias="find")
    _index: Mapping[str, int] = attrs.field(alias="index")  # a text's place in `texts`

    @classmethod
    def of(cls, tokens: Mapping[str, int]) -> ControlText:
        """From each control token's text and id."""
        texts = tuple(sorted((t for t in tokens if t), key=lambda t: (-len(t), t)))
        find = None
        if texts:
            try:
                find = re.compile(_trie_pattern(texts))
            except RecursionError:  # texts nested a thousand deep: the plain alternation
                find = re.compile("|".join(re.escape(t) for t in texts))
        index = {t: i for i, t in enumerate(texts)}
        return cls(texts=texts, ids=dict(tokens), find=find, index=index)

    def escape(self, text: str) -> str:
        """`text` with the escape character doubled and every control token's text
        replaced by an escape sequence naming it."""
        text = text.replace(_ESC, _ESC + _ESC)
        if self._find is None:
            return text
        return self._find.sub(lambda m: f"{_ESC}{self._index[m.group(0)]}{_END}", text)

    def unescape(self, text: str) -> str:
        """What `escape` was given."""
        if _ESC not in text:
            return text

        def back(m: re.Match[str]) -> str:
            return _ESC if m.group(1) else self.texts[int(m.group(2))]

        return _UNESCAPE.sub(back, text)

    def escape_all(self, value: Any) -> Any:
        """Every string in a JSON-like value (message contents, tool calls, tool
        schemas; keys too) escaped."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            return {self.escape_all(k): self.escape_all(v) for k, v in value.items()}
        if isinstance(value, Sequence):
            return [self.escape_all(v) for v in value]
        return value

    def split(self, rendered: str, *, escaped: bool = True) -> list[str | int]:
        """A rendered prompt as plain pieces (unescaped: the client's text as sent,
        the template's as written) and the ids of the control tokens between them.
        With `escaped=False` the text was never escaped (a raw prompt, whose control
        tokens' texts are meant): its pieces are kept as they are."""
        out: list[str | int] = []
        start = 0
        piece = self.unescape if escaped else str
        if self._find is not None:
            for m in self._find.finditer(rendered):
                if m.start() > start:
                    out.append(piece(rendered[start : m.start()]))
                out.append(self.ids[m.group(0)])
                start = m.end()
        if start < len(rendered):
            out.append(piece(rendered[start:]))
        return out
