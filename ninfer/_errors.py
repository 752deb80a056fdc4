"""The errors ninfer raises on purpose, for the server's modules: defined with the
engine (`ninfer/engine/_errors.py`, the hierarchy and what each means), which raises
them too, and exported by its torch-free face."""

from __future__ import annotations

from ninfer.engine import (
    ArtifactError,
    ConfigError,
    EngineError,
    EngineStopped,
    NinferError,
    RequestInvalid,
)

__all__ = [
    "ArtifactError",
    "ConfigError",
    "EngineError",
    "EngineStopped",
    "NinferError",
    "RequestInvalid",
]
