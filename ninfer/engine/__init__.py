"""The engine: one thread owns torch, the model, the KV cache and every sampler.

This package's public face is its contract (`ninfer.engine._contract`), free of torch
and of trio: `import ninfer.engine` loads neither. The torch side (`_engine`, `_model`,
`_gguf`, `_loader`, `_tokenizer`, `_sampling`, `_kvpool`, `_textstream`,
`_invariance`, `_selfcheck`, `_controltext`, `_speculative`) is started by
`ninfer.engine._runtime.create_engine`, which only the bridge (`ninfer._bridge`)
calls, on the engine thread.
"""

from __future__ import annotations

from ninfer.engine._contract import (
    DTYPE_NAMES,
    GRAMMAR_LIMIT,
    KV_DTYPES,
    KV_HEADROOM_BYTES,
    PRESET_FIELDS,
    SPEC_BACKENDS,
    WEIGHT_MODES,
    ChatTemplate,
    ChatText,
    CompiledGrammar,
    EngineConfig,
    EngineStatistics,
    EngineTimings,
    Event,
    EventSink,
    Finish,
    FinishReason,
    GenerationRequest,
    KVSizing,
    ModelIdentity,
    PathCheck,
    RequestHandle,
    SamplingParams,
    SamplingPreset,
    ServedModel,
    SpeculativeCounts,
    ThinkingSupport,
    TokenDelta,
    Tokenizer,
    TokenLogprob,
    Usage,
)

__all__ = [
    "DTYPE_NAMES",
    "GRAMMAR_LIMIT",
    "KV_DTYPES",
    "KV_HEADROOM_BYTES",
    "PRESET_FIELDS",
    "SPEC_BACKENDS",
    "WEIGHT_MODES",
    "ChatTemplate",
    "ChatText",
    "CompiledGrammar",
    "EngineConfig",
    "EngineStatistics",
    "EngineTimings",
    "Event",
    "EventSink",
    "Finish",
    "FinishReason",
    "GenerationRequest",
    "KVSizing",
    "ModelIdentity",
    "PathCheck",
    "RequestHandle",
    "SamplingParams",
    "SamplingPreset",
    "ServedModel",
    "SpeculativeCounts",
    "ThinkingSupport",
    "TokenDelta",
    "TokenLogprob",
    "Tokenizer",
    "Usage",
]
