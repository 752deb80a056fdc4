"""One frontend per protocol, built once when the model is ready; the route table maps
(method, path) to them. A new protocol plugs in as one more `Frontend`."""

from __future__ import annotations

from ninfer.frontends._anthropic import MessagesFrontend
from ninfer.frontends._base import (
    Answer,
    Choice,
    FailingAnswer,
    Frontend,
    FrontendContext,
    Outcome,
    Prepared,
)
from ninfer.frontends._budget import sampling_record
from ninfer.frontends._grammar import GrammarCompiler
from ninfer.frontends._native import NativeFrontend, TokenizeFrontend, server_props
from ninfer.frontends._openai import ChatFrontend, CompletionsFrontend, model_card, model_list
from ninfer.frontends._response_store import ResponseStore
from ninfer.frontends._responses import ResponsesFrontend

__all__ = [
    "Answer",
    "ChatFrontend",
    "Choice",
    "CompletionsFrontend",
    "FailingAnswer",
    "Frontend",
    "FrontendContext",
    "GrammarCompiler",
    "MessagesFrontend",
    "NativeFrontend",
    "Outcome",
    "Prepared",
    "ResponseStore",
    "ResponsesFrontend",
    "TokenizeFrontend",
    "model_card",
    "model_list",
    "sampling_record",
    "server_props",
]
