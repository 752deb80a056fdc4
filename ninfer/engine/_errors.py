"""Errors raised by the ninfer package (not the wire: protocols owns envelopes). They
live with the engine, the innermost layer that raises them, and the server takes them
from here (`ninfer/_errors.py` names them for it).

NinferError
├── ArtifactError        a model file is missing, corrupt, or of a kind ninfer cannot run
├── ConfigError          a configuration value is refused at start-up (names the flag)
└── EngineError          the engine cannot serve a request or has stopped
    ├── RequestInvalid   the request cannot run on this model (budget, empty prompt);
    │                    the caller's fault, raised by `Engine.submit`
    └── EngineStopped    the engine thread is not running (stopped or died)
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ConfigError",
    "EngineError",
    "EngineStopped",
    "NinferError",
    "RequestInvalid",
]


class NinferError(Exception):
    """Base of every error ninfer raises on purpose."""


class ArtifactError(NinferError):
    """A model artifact is missing, corrupt, fails its checksum, or is unsupported."""


class ConfigError(NinferError):
    """A configuration value was refused; the message names the flag."""


class EngineError(NinferError):
    """The engine could not serve a request."""


class RequestInvalid(EngineError):
    """The request cannot run on this model; `param` names the field at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineStopped(EngineError):
    """The engine thread is not running."""
