"""How much memory is left for the KV pool: on CUDA the device's free memory, on the CPU
the memory the kernel says is available, within the process's cgroup limit where one
is set (a container's or a systemd unit's)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE", "advise_huge_pages", "available_memory", "read_only"]

# Linux's transparent huge page on x86-64 and arm64 (4 KiB base pages), and madvise's code
# asking for them; mprotect's for read-only pages.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_PROT_READ = 1


@functools.cache
def _libc(name: str) -> object | None:
    """libc's madvise or mprotect (both (address, length, int) -> int) on Linux, else
    None."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(None, use_errno=True)[name]
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
        return fn
    return None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for transparent huge pages over the 2 MiB-aligned part of a fresh CPU tensor's
    memory, before its first store (Linux; honoured where the system's setting is
    "madvise" or "always", a no-op elsewhere). Whether the call was made and accepted."""
    fn = _libc("madvise")
    if fn is None or t.device.type != "cpu" or not t.is_contiguous():
        return False
    start = t.data_ptr()
    begin = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= begin:
        return False
    return bool(fn(begin, end - begin, _MADV_HUGEPAGE) == 0)  # type: ignore[operator]


def read_only(t: torch.Tensor) -> bool:
    """The pages under a contiguous CPU tensor that is a whole mapping (page-aligned)
    made read-only (Linux; a no-op elsewhere). Whether the call was made and accepted."""
    fn = _libc("mprotect")
    if fn is None or t.device.type != "cpu" or not t.is_contiguous():
        return False
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    return bool(fn(start, end - start, _PROT_READ) == 0)  # type: ignore[operator]


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
    """The least room (limit less usage) of the process's memory cgroup and its
    ancestors (v2, else v1); None where none sets a limit or none can be read.

    Where the cgroup's folder is depends on where the hierarchy is mounted: on a host at
    its path, inside a container at the container's part of it (the path names the
    host's cgroups above it), so each tail of the path is tried, longest first. Limits
    nest (a child cannot use more than its parent allows), so every folder from the one
    found up to the mount's root is read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":  # v2 (or the unified tree of a hybrid)
            files = ("memory.max", "memory.current")
            mounts: tuple[Path, ...] = (root, root / "unified")
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            mounts = (root / "memory",)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for mount in mounts:
            for start in range(len(parts) + 1):
                folder = mount.joinpath(*parts[start:])
                if (folder / files[1]).is_file():
                    return _least_room(mount, folder, files)
    return None


def _least_room(mount: Path, folder: Path, files: tuple[str, str]) -> int | None:
    """The least room of `folder` and the folders above it up to `mount`."""
    rooms = []
    while True:
        room = _room(folder / files[0], folder / files[1])
        if room is not None:
            rooms.append(room)
        if folder == mount or mount not in folder.parents:
            return min(rooms, default=None)
        folder = folder.parent


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit = limit_file.read_text().strip()
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1's "no limit"
        return None
    return max(0, int(limit) - usage)
