"""Thinking: a reasoning model's `<think>` block, asked for or not, and read apart from
the answer on every protocol.

A chat template that can think (`ThinkingSupport`: Qwen 3's `enable_thinking`, or a reply
that begins inside `<think>` as DeepSeek-R1's distills and QwQ) thinks by default unless
the server was started with --no-thinking; a request may choose either way (OpenAI's
`reasoning_effort` or `chat_template_kwargs.enable_thinking`, Anthropic's `thinking`, the
Responses API's `reasoning.effort`). The reasoning is what the model writes between
`<think>` (or the prompt's open block) and `</think>`; the answer, whatever follows.
A grammar (structured outputs, tools) applies to the answer only: it is preceded by a
free reasoning block that must close first.
"""

from __future__ import annotations

from typing import Any

import attrs

from ninfer._config import ServerConfig
from ninfer.engine import THINK_CLOSE, THINK_OPEN, ChatText, ThinkingSupport, opens_thinking
from ninfer.frontends._tools import (
    TextPiece,
    held_suffix,
)
from protocols import ApiError

__all__ = [
    "ReasoningPiece",
    "ThinkSplitter",
    "ThinkingAsk",
    "ThinkingMode",
    "close_unwanted_thinking",
    "resolve_thinking",
]

OPEN, CLOSE = THINK_OPEN, THINK_CLOSE
NO_THINKING = (
    "this model's chat template has no thinking support (no reasoning block), so "
    "thinking cannot be turned on"
)
NO_PRESERVING = (
    "this model's chat template drops the reasoning of earlier turns (it takes no "
    "preserve_thinking)"
)


@attrs.frozen
class ThinkingAsk:
    """What a request said about thinking: None where it said nothing; `param` is
    where it said it (for a refusal)."""

    enabled: bool | None = None
    preserve: bool | None = None
    param: str = ""
    preserve_param: str = ""


@attrs.frozen
class ThinkingMode:
    """How one request thinks: the template variables it is rendered with, and how its
    output is read."""

    enabled: bool
    preserve: bool
    asked: bool  # the request chose (else the server's default)

    def variables(self) -> dict[str, Any]:
        """The template's names for it (preserve under both spellings templates use)."""
        return {
            "enable_thinking": self.enabled,
            "preserve_thinking": self.preserve,
            "preserved_thinking": self.preserve,
        }

    def log_fields(self) -> dict[str, Any]:
        """request_start's `thinking`."""
        source = "request" if self.asked else "server"
        return {"thinking": {"enabled": self.enabled, "preserve": self.preserve, "source": source}}


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError("invalid_request", message, param=param, code="unsupported_parameter")


def resolve_thinking(
    ask: ThinkingAsk, support: ThinkingSupport | None, cfg: ServerConfig
) -> ThinkingMode | None:
    """The request's choice over the server's default (--no-thinking, --preserve-thinking);
    None for a template that cannot think. Asking a template that cannot do it to think,
    or to preserve, is refused by name; turning either off is always accepted."""
    if support is None:
        if ask.enabled:
            raise _unsupported(ask.param, NO_THINKING)
        if ask.preserve:
            raise _unsupported(ask.preserve_param, NO_THINKING)
        return None
    if ask.preserve and not support.preserve:
        raise _unsupported(ask.preserve_param, NO_PRESERVING)
    enabled = (not cfg.no_thinking) if ask.enabled is None else ask.enabled
    preserve = cfg.preserve_thinking if ask.preserve is None else ask.preserve
    return ThinkingMode(
        enabled=enabled,
        preserve=preserve and support.preserve,
        asked=ask.enabled is not None,
    )


def close_unwanted_thinking(prompt: ChatText, mode: ThinkingMode | None) -> ChatText:
    """With thinking off, a prompt that still opens a reasoning block (a template
    without a switch) gets it closed, empty, so that the model answers at once."""
    if mode is not None and not mode.enabled and opens_thinking(prompt.text):
        return ChatText(prompt.text + "\n" + CLOSE + "\n\n")
    return prompt


@attrs.frozen
class ReasoningPiece:
    text: str


@attrs.define
class ThinkSplitter:
    """Splits an output into reasoning and answer as it arrives. Before anything: a
    `<think>` (after blanks) opens reasoning, else it is all answer; the reasoning ends
    at `</think>`, and the blank lines after it are not the answer's. The newline that
    follows `<think>` and those before `</think>` are the markup's, not the reasoning's
    (Qwen writes `<think>\\nR\\n</think>\\n\\nA`)."""

    state: str = "start"  # start | reasoning | after | answer
    buffer: str = ""
    began: bool = False  # some reasoning was given (so a leading newline is its own)
    counted: int = 0  # the tokens that were reasoning (the markup's included)
    _pending: int = 0  # tokens fed before the output showed whether it reasons

    @classmethod
    def opened(cls) -> ThinkSplitter:
        """For a reply whose prompt opened `<think>`: it begins as reasoning."""
        return cls(state="reasoning")

    @property
    def thinking(self) -> bool:
        """Still before the answer (what a token fed now counts as)."""
        return self.state in ("start", "reasoning")

    def feed(self, text: str, tokens: int = 0) -> list[ReasoningPiece | TextPiece]:
        """The pieces `text` completes; its `tokens` are counted as reasoning when they
        come before the answer (at the start, once a `<think>` shows they were)."""
        before = self.state
        self.buffer += text
        out: list[ReasoningPiece | TextPiece] = []
        while self._step(out):
            pass
        if before == "start":
            self._pending += tokens
            if self.state != "start":  # decided: reasoning (counted) or the answer (not)
                self.counted += self._pending if self.state != "answer" else 0
                self._pending = 0
        elif before == "reasoning":
            self.counted += tokens
        return out

    def _step(self, out: list[ReasoningPiece | TextPiece]) -> bool:
        buf = self.buffer
        if self.state == "start":
            lead = buf.lstrip(" \n")
            if lead.startswith(OPEN):
                self.buffer, self.state = lead[len(OPEN) :], "reasoning"
                return True
            if OPEN.startswith(lead):  # blanks, or the start of <think>: wait
                return False
            self.state = "answer"
            return True
        if self.state == "reasoning":
            if not self.began:  # the newline after <think> is the markup's
                if buf.startswith("\n"):
                    buf = buf[1:]
                elif not buf:
                    return False
                self.began = True
            at = buf.find(CLOSE)
            if at >= 0:
                piece = buf[:at].rstrip("\n")
                if piece:
                    out.append(ReasoningPiece(piece))
                self.buffer, self.state = buf[at + len(CLOSE) :], "after"
                return True
            keep = held_suffix(buf, CLOSE)
            body = buf[: len(buf) - keep]
            sent = body.rstrip("\n")  # newlines may be the ones before </think>
            keep += len(body) - len(sent)
            if sent:
                out.append(ReasoningPiece(sent))
            self.buffer = buf[len(buf) - keep :] if keep else ""
            return False
        if self.state == "after":
            rest = buf.lstrip(" \n")
            if not rest:
                self.buffer = ""
                return False
            self.buffer, self.state = rest, "answer"
            return True
        if buf:
            out.append(TextPiece(buf))
        self.buffer = ""
        return False

    def finish(self) -> list[ReasoningPiece | TextPiece]:
        """What was held back, when the output ended (a reasoning block the budget cut
        stays reasoning)."""
        buf, self.buffer = self.buffer, ""
        if not buf:
            return []
        if self.state == "reasoning":
            return [ReasoningPiece(buf.strip("\n"))] if buf.strip("\n") else []
        if self.state == "start" and not buf.strip():
            return []
        return [TextPiece(buf)]
