"""One frontend per protocol, built once when the model is ready. Each declares its
routes (`Routed.routes()`); the app's route table is made of `FRONTENDS`' routes and
its own (probes, metrics, the contract). A new protocol plugs in as one more class
and one more line in `FRONTENDS`."""

from __future__ import annotations

from ninfer.frontends._anthropic import MessagesFrontend
from ninfer.frontends._base import (
    Answer,
    Choice,
    Count,
    FailingAnswer,
    Frontend,
    FrontendContext,
    FrontendRoute,
    Generate,
    Look,
    Outcome,
    PathArgs,
    Prepared,
    ProgressAnswer,
    Routed,
)
from ninfer.frontends._embeddings import EmbeddingsFrontend, LlamaEmbeddingFrontend
from ninfer.frontends._grammar import GrammarCompiler
from ninfer.frontends._llama import LlamaCompletionFrontend
from ninfer.frontends._native import NativeFrontend, TokenizeFrontend, server_props
from ninfer.frontends._openai import ChatFrontend, CompletionsFrontend, ModelsFrontend
from ninfer.frontends._responses import ResponsesFrontend
from ninfer.frontends._sampling import sampling_record

__all__ = [
    "FRONTENDS",
    "Answer",
    "ChatFrontend",
    "Choice",
    "CompletionsFrontend",
    "Count",
    "EmbeddingsFrontend",
    "FailingAnswer",
    "Frontend",
    "FrontendContext",
    "FrontendRoute",
    "Generate",
    "GrammarCompiler",
    "LlamaEmbeddingFrontend",
    "Look",
    "MessagesFrontend",
    "ModelsFrontend",
    "NativeFrontend",
    "Outcome",
    "PathArgs",
    "Prepared",
    "ProgressAnswer",
    "ResponsesFrontend",
    "Routed",
    "TokenizeFrontend",
    "sampling_record",
    "server_props",
]

# Every protocol's routes: the route table is built from these classes, and the
# lifespan builds one of each, from the FrontendContext, once the model is loaded.
FRONTENDS: tuple[type[Routed], ...] = (
    NativeFrontend,
    LlamaCompletionFrontend,
    TokenizeFrontend,
    ModelsFrontend,
    ChatFrontend,
    CompletionsFrontend,
    MessagesFrontend,
    ResponsesFrontend,
    EmbeddingsFrontend,
    LlamaEmbeddingFrontend,
)
