"""Starting the engine on its thread: the process-wide settings, made in this one place,
the native kernels found (or built) and configured, and the engine built around a model
loader. Importing this module imports torch."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
from structlog.typing import FilteringBoundLogger

from ninfer.engine._contract import EngineConfig, EventSink
from ninfer.engine._engine import DTYPES, Engine
from ninfer.engine._errors import ConfigError
from ninfer.engine._kernels import build_kernels, load_kernels, torch_isa
from ninfer.engine._kvpool import KVPages
from ninfer.engine._loader import LoadedModel, load_model
from ninfer.engine._model import Transformer
from ninfer.engine._native import device_unsupported

__all__ = [
    "KERNEL_SPIN_US",
    "SWITCH_INTERVAL_S",
    "KernelChoice",
    "configure_process",
    "cpu_count",
    "create_engine",
    "start_kernels",
    "step_seconds",
]

# The engine thread runs Python between torch calls while holding the GIL; with the
# default 5 ms switch interval every syscall of the event loop (each accept, read and
# write) can wait that long to get the GIL back, and a burst of requests queues behind
# it. A shorter interval keeps the event loop responsive.
SWITCH_INTERVAL_S = 0.0005
# How long a native kernel thread spins for the next call before it sleeps: longer than
# the gaps between the calls of one decode step (a few microseconds), shorter than the
# gap between steps that an idle or lightly loaded server leaves (docs/engine.md).
KERNEL_SPIN_US = 100
# --kernels auto where the native kernels have no vector build for this CPU (their plain
# build: one libm fma call a lane): a decode step is timed this many times each way
# (after one untimed), and the faster kernels serve.
CHOICE_STEPS = 5


def cpu_count() -> int:
    """The CPUs this process may run on: its affinity mask, within a cgroup v2 CPU quota
    (a container's `--cpus`, a systemd unit's CPUQuota=) where one is set."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def configure_process(*, threads: int | None) -> None:
    """The process settings the engine depends on. Called once, on the engine thread
    (torch's intra-op thread count is read from the thread that runs the ops)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    torch.set_num_threads(threads or cpu_count())


@attrs.frozen
class KernelChoice:
    """Which kernels the model is loaded for: native (and on which build), or torch and
    why."""

    native: bool
    isa: str = ""
    threads: int = 1
    reason: str = ""

    def describe(self) -> str:
        if self.native:
            return f"native {self.isa}, {self.threads} threads"
        return f"torch ({self.reason})" if self.reason else "torch"


def start_kernels(config: EngineConfig, progress: Callable[[str], None]) -> KernelChoice:
    """The native kernels for this engine: found (or built, once), loaded and configured
    for the instruction set torch dispatches to; or why the torch path runs instead.
    --kernels native makes a missing library an error; auto says why and goes on."""
    threads = config.threads or cpu_count()
    if config.kernels == "torch":
        return KernelChoice(False, reason="--kernels torch")
    why = device_unsupported(config.device, DTYPES[config.dtype])
    if why is None and config.page_size % 16:
        why = f"pages of {config.page_size} tokens: the native attention reads keys 16 at a time"
    if why is None:
        cache = Path(config.cache_dir) if config.cache_dir else None
        built = build_kernels(cache, progress=progress)
        if built.path is None:
            why = f"the native kernels could not be built: {built.reason}"
        else:
            try:
                load_kernels(built.path)
                isa = str(torch.ops.ninfer.configure(torch_isa(), threads, KERNEL_SPIN_US))
                return KernelChoice(True, isa=isa, threads=threads)
            except (OSError, RuntimeError) as exc:
                why = f"the native kernels could not be loaded: {exc}"
    if config.kernels == "native":
        raise ConfigError(f"--kernels native: {why}")
    progress(f"kernels: torch's ({why})")
    return KernelChoice(False, reason=why)


def step_seconds(model: Transformer, device: str) -> float:
    """The median time of one decode step of `model` (one row, a few positions into a
    small pool of its own), over CHOICE_STEPS after one untimed."""
    kv = KVPages.allocate(model.args, n_pages=2, page_size=16, dtype=model.dtype,
                          device=device, keys_transposed=model.native is not None)  # fmt: skip
    kv.zero_pages([1, 2])
    table = torch.tensor([[1, 2]], device=device)
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    times = []
    with torch.inference_mode():
        for i in range(CHOICE_STEPS + 1):
            began = time.perf_counter()
            model.forward(token, torch.tensor([[i]], device=device), table, kv, last_only=True)
            times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def choose_by_step(
    loaded: LoadedModel, config: EngineConfig, progress: Callable[[str], None]
) -> LoadedModel:
    """--kernels auto on the native kernels' plain build (no vector build for this CPU,
    or torch held to its plain code by ATEN_CPU_CAPABILITY): a decode step timed on them
    and on torch's kernels, and the faster serves; the console says which and why."""
    model, source = loaded.transformer, loaded.source
    if model.native is None or source is None:
        return loaded
    native = step_seconds(model, config.device)
    held = model.kernel_state()
    model.to_torch(source, config.weights)
    torched = step_seconds(model, config.device)
    figures = f"a decode step {native * 1e3:.1f} ms on them, {torched * 1e3:.1f} ms on torch's"
    if torched < native:
        why = f"the native kernels' plain build is slower here: {figures}"
        progress(f"kernels: torch's ({why})")
        return attrs.evolve(loaded, kernels=f"torch ({why})")
    model.restore_kernels(held)
    progress(f"kernels: the native plain build ({figures})")
    return loaded


def create_engine(
    model_path: Callable[[], str],
    config: EngineConfig,
    sink: EventSink,
    *,
    log: FilteringBoundLogger,
    progress: Callable[[str], None],
) -> Engine:
    """An engine whose `run` resolves `model_path()` (which may fetch the file), starts
    the kernels and loads the model, then serves."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available to torch")

    def load() -> LoadedModel:
        path = model_path()
        kernels = start_kernels(config, progress)
        loaded = load_model(
            path,
            dtype=DTYPES[config.dtype],
            device=config.device,
            max_positions=config.max_context or 1 << 20,
            weights=config.weights,
            native=kernels.native,
            chat_template=config.chat_template,
            cache_dir=config.cache_dir,
            packed_cache=config.packed_cache,
            progress=progress,
        )
        if loaded.transformer.native is None and loaded.kernels != "torch":
            return loaded  # the model, not the library, kept it off them: said so
        loaded = attrs.evolve(loaded, kernels=kernels.describe())
        if config.kernels == "auto" and kernels.isa == "default":
            loaded = choose_by_step(loaded, config, progress)
        return loaded

    return Engine(load, config, sink, log=log)
