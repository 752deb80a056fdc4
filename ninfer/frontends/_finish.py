"""How an engine request ended, in each protocol's words: the one table every answer
reads, and the one rule of an answer that ended by itself having made calls."""

from __future__ import annotations

import attrs

from protocols import AnthropicStop, ChatFinish, NativeFinish, OpenAIFinish

__all__ = ["FINISH", "Words", "anthropic_stop", "chat_finish", "ended_with_calls"]


@attrs.frozen
class Words:
    """One engine finish reason, as each protocol says it."""

    native: NativeFinish
    openai: OpenAIFinish
    anthropic: AnthropicStop
    complete: bool  # it ended by itself (a Response is `completed`, else `incomplete`)


# The engine's reasons (ninfer.engine.FinishReason) that end an answer; cancelled and
# error end a request without one.
FINISH: dict[str, Words] = {
    "eos": Words("eos", "stop", "end_turn", True),
    "stop": Words("stop", "stop", "stop_sequence", True),
    "length": Words("length", "length", "max_tokens", False),
    "context": Words("length", "length", "max_tokens", False),
    # past its reservation no free page was left (the native route reserves its whole
    # budget, so never there)
    "capacity": Words("length", "length", "max_tokens", False),
}


def ended_with_calls(reason: str, calls: int, cut: bool) -> bool:
    """Whether an answer ended by itself (end of sequence, or its grammar complete)
    having made calls: OpenAI's `tool_calls`, Anthropic's `tool_use`."""
    return bool(calls) and not cut and FINISH[reason].complete


def chat_finish(reason: str, calls: int = 0, cut: bool = False) -> ChatFinish:
    """A chat choice's finish_reason (`calls` made, the last `cut` short)."""
    return "tool_calls" if ended_with_calls(reason, calls, cut) else FINISH[reason].openai


def anthropic_stop(reason: str, calls: int = 0, cut: bool = False) -> AnthropicStop:
    """An Anthropic answer's stop_reason, likewise."""
    return "tool_use" if ended_with_calls(reason, calls, cut) else FINISH[reason].anthropic
