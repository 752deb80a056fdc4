"""How much memory is left for the KV pool: on CUDA the device's free memory, on the CPU
the memory the kernel says is available, within the process's cgroup limit where one
is set (a container's or a systemd unit's)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["available_memory"]


def available_memory(device: str) -> tuple[int, str]:
    """Bytes free now for `device`, and where that figure came from."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "cuda free memory"
    host = _meminfo_available()
    if host is None:  # not Linux: the physical pages free
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        host, source = int(pages), "free physical pages"
    else:
        source = "MemAvailable"
    room = _cgroup_room()
    if room is not None and room < host:
        return room, "cgroup memory limit"
    return host, source


def _meminfo_available() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def _cgroup_room(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The process's cgroup memory limit less its usage (v2, else v1); None where no
    limit is set or none can be read. A cgroup's own folder is tried, then the mount's
    root (inside a container the process's cgroup is mounted there)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":  # v2 (or the unified tree of a hybrid)
            files = ("memory.max", "memory.current")
            mounts: tuple[Path, ...] = (
                root / path.lstrip("/"),
                root,
                root / "unified" / path.lstrip("/"),
            )
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            mounts = (root / "memory" / path.lstrip("/"), root / "memory")
        else:
            continue
        for folder in mounts:
            room = _room(folder / files[0], folder / files[1])
            if room is not None:
                return room
    return None


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit = limit_file.read_text().strip()
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1's "no limit"
        return None
    return max(0, int(limit) - usage)
