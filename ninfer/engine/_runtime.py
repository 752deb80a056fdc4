"""Starting the engine on its thread: the process-wide settings, made in this one place,
and the engine built around a model loader. Importing this module imports torch."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from structlog.typing import FilteringBoundLogger

from ninfer.engine._contract import EngineConfig, EventSink
from ninfer.engine._engine import DTYPES, Engine
from ninfer.engine._errors import ConfigError
from ninfer.engine._loader import LoadedModel, load_model

__all__ = ["SWITCH_INTERVAL_S", "configure_process", "create_engine"]

# The engine thread runs Python between torch calls while holding the GIL; with the
# default 5 ms switch interval every syscall of the event loop (each accept, read and
# write) can wait that long to get the GIL back, and a burst of requests queues behind
# it. A shorter interval keeps the event loop responsive.
SWITCH_INTERVAL_S = 0.0005


def configure_process(*, threads: int | None) -> None:
    """The process settings the engine depends on. Called once, on the engine thread
    (torch's intra-op thread count is read from the thread that runs the ops)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if threads:
        torch.set_num_threads(threads)


def create_engine(
    model_path: Callable[[], str],
    config: EngineConfig,
    sink: EventSink,
    *,
    log: FilteringBoundLogger,
    progress: Callable[[str], None],
) -> Engine:
    """An engine whose `run` resolves `model_path()` (which may fetch the file) and
    loads it, then serves."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available to torch")

    def load() -> LoadedModel:
        return load_model(
            model_path(),
            dtype=DTYPES[config.dtype],
            device=config.device,
            max_positions=config.max_context or 1 << 20,
            weights=config.weights,
            chat_template=config.chat_template,
            progress=progress,
        )

    return Engine(load, config, sink, log=log)
