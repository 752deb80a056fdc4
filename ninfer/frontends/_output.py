"""Reading an answer's output, for every protocol: apart from its reasoning (when the
request thinks, `_reasoning.ThinkSplitter`), and for tool calls (when it may call tools,
`_tools.ToolStream`), as it arrives (`OutputReader`, cutting it into pieces that a
streaming answer writes in its protocol's words: `PieceWriter`) or whole, read as the
stream reads it (`read_output`, `ReadOutput`); `Reading` says how a request's output is
read."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence

import attrs

from ninfer.frontends._reasoning import ReasoningPiece, ThinkSplitter
from ninfer.frontends._tools import (
    CallArgs,
    CallEnd,
    CallStart,
    ParsedCall,
    TextPiece,
    ToolStream,
)

__all__ = ["OutputReader", "Piece", "PieceWriter", "ReadOutput", "Reading", "read_output"]


Piece = ReasoningPiece | TextPiece | CallStart | CallArgs | CallEnd


class PieceWriter(abc.ABC):
    """A streaming answer: what its protocol writes for each kind of piece of a choice's
    output (`OutputReader`'s), each method returning frames; `write` dispatches."""

    def write(self, choice: int, pieces: Iterable[Piece]) -> list[bytes]:
        frames: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                frames += self.on_reasoning(choice, piece.text)
            elif isinstance(piece, TextPiece):
                frames += self.on_text(choice, piece.text)
            elif isinstance(piece, CallStart):
                frames += self.on_call_start(choice, piece)
            elif isinstance(piece, CallArgs):
                frames += self.on_call_args(choice, piece)
            else:
                frames += self.on_call_end(choice, piece)
        return frames

    @abc.abstractmethod
    def on_reasoning(self, choice: int, text: str) -> list[bytes]: ...

    @abc.abstractmethod
    def on_text(self, choice: int, text: str) -> list[bytes]: ...

    @abc.abstractmethod
    def on_call_start(self, choice: int, call: CallStart) -> list[bytes]: ...

    @abc.abstractmethod
    def on_call_args(self, choice: int, args: CallArgs) -> list[bytes]: ...

    @abc.abstractmethod
    def on_call_end(self, choice: int, end: CallEnd) -> list[bytes]: ...


@attrs.define
class OutputReader:
    """An answer's output as it arrives: reasoning (when the request thinks), then text,
    and calls (when it may call tools). Without either, text passes as it comes."""

    splitter: ThinkSplitter | None = None
    tools: ToolStream | None = None

    @classmethod
    def of(cls, thinking: bool, opens: bool, tools: bool) -> OutputReader:
        splitter = None
        if thinking:
            splitter = ThinkSplitter.opened() if opens else ThinkSplitter()
        return cls(splitter, ToolStream() if tools else None)

    def feed(self, text: str, tokens: int = 0) -> list[Piece]:
        """The pieces `text` completes; its `tokens` count as reasoning while the output
        has not reached the answer."""
        if self.splitter is None:
            return self._answer([TextPiece(text)] if text else [])
        return self._answer(self.splitter.feed(text, tokens))

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.counted if self.splitter is not None else 0

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self.splitter is not None:
            pieces += self._answer(self.splitter.finish())
        if self.tools is not None:
            pieces += self.tools.finish()
        return pieces

    def _answer(self, pieces: Sequence[ReasoningPiece | TextPiece]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, TextPiece) and self.tools is not None:
                out += self.tools.feed(p.text)
            elif p.text:
                out.append(p)
        return out

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    @property
    def open_call(self) -> bool:
        return self.tools.open_call if self.tools is not None else False


@attrs.frozen
class Reading:
    """How a request's output is read: apart from its reasoning (`thinking`; `opens`:
    the prompt opened the block), and for calls (`tools`). Plain when neither. `spell`
    gives each token's bytes (a whole answer's reasoning tokens are counted from them)."""

    thinking: bool = False
    opens: bool = False
    tools: bool = False
    spell: Callable[[int], bytes] = attrs.field(default=lambda _t: b"", eq=False)

    @property
    def plain(self) -> bool:
        return not (self.thinking or self.tools)

    def reader(self) -> OutputReader:
        return OutputReader.of(self.thinking, self.opens, self.tools)

    def read(self, text: str, token_ids: Sequence[int]) -> ReadOutput:
        return read_output(
            text, token_ids, self.spell, thinking=self.thinking, opens=self.opens,
            tools=self.tools,
        )  # fmt: skip


@attrs.frozen
class ReadOutput:
    """A whole output read as the stream reads it."""

    reasoning: str | None  # None: the request did not think
    text: str
    calls: tuple[ParsedCall, ...]  # complete calls only
    truncated: bool  # a call was cut short (and is left out)
    reasoning_tokens: int

    @property
    def has_text(self) -> bool:
        """Whether the answer has a text part (a message, a text block): the rule every
        protocol shares, text when there is any, or when there is no call (an empty
        answer is still one)."""
        return bool(self.text) or not self.calls


def read_output(
    text: str,
    token_ids: Sequence[int],
    spell: Callable[[int], bytes],
    *,
    thinking: bool,
    opens: bool,
    tools: bool,
) -> ReadOutput:
    """A finished output read as the stream reads it: `text` (the engine's, cut at a
    stop string) for the reasoning, answer and calls; its tokens (each spelled by
    `spell`) for how many were reasoning, counted where the stream counts them."""
    import codecs

    reader = OutputReader.of(thinking, opens, tools)
    pieces = reader.feed(text) + reader.finish()
    counted = 0
    if thinking:  # the tokens again, as the stream gets them, until the answer begins
        counter = ThinkSplitter.opened() if opens else ThinkSplitter()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        seen = 0
        for t in token_ids:
            if not counter.thinking or seen >= len(text):
                break
            piece = decoder.decode(spell(t))
            seen += len(piece)
            counter.feed(piece, 1)
        counted = counter.counted
    reasoning = [p.text for p in pieces if isinstance(p, ReasoningPiece)]
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    done: list[int] = []
    for p in pieces:
        if isinstance(p, CallStart):
            names[p.index], args[p.index] = p.name, []
        elif isinstance(p, CallArgs):
            args[p.index].append(p.text)
        elif isinstance(p, CallEnd):
            done.append(p.index)
    return ReadOutput(
        "".join(reasoning) if thinking else None,
        "".join(p.text for p in pieces if isinstance(p, TextPiece)),
        tuple(ParsedCall(names[i], "".join(args[i])) for i in done),
        reader.open_call,
        counted,
    )
