"""The native kernels' packed matrices kept in a file between starts, and mapped by the
next.

Packing copies every matrix of the file into the kernels' panels (`_native.pack_tensors`):
a deterministic function of the file's bytes and the packing code. llama-server maps its
file and serves from the blocks in place; ninfer packed into fresh memory at every
start, ~1 s for a 1.7B model on 4 KiB pages and 2-3.5 s on huge pages in a virtual
machine whose host supplies each fresh one (benchmarks.md, "Packed matrices mapped").
Now a start packs into a new file under the cache directory's `packed/`, mapped shared
(`FileArena`: the page cache's pages, mapped as 2 MiB pages where the filesystem keeps
large folios, XFS and ext4 from Linux 6.16; a first start takes about as long as
before), and keeps it; the next start of the same model file,
kernels library, engine code and CPU maps that file and skips packing (`MappedArena`).
Either way the matrices' pages are then read-only: nothing writes a packed matrix, and
a bug that tried would stop the process rather than change the model or the kept file.

A kept pack is `<key>.bin` (the arena's buffers, each at a 2 MiB-aligned offset) and
`<key>.json` (every matrix's offset and size in packing order, each buffer's extent and
a checksum of its first and last 4 KiB, and the .bin's identity: size, inode,
modification time, as git's index trusts a file's stat). A start adopts it only when
the JSON parses to exactly this version's fields, the identity and checksums match and
the load asks for the same sizes in the same order; anything else is packed again and
kept anew. The .bin is written under a temporary name and renamed once whole, so no
start maps a part of one; it is never written in place after (a kept file a running
server maps is replaced by a rename, never truncated).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from ninfer.engine._checkcache import engine_source_digest, file_digest, processor
from ninfer.engine._kept import keep_file, mark_used, os_error
from ninfer.engine._memory import HUGE_PAGE, read_only
from ninfer.engine._native import PackArena

__all__ = [
    "KEPT_PACKS",
    "PACK_VERSION",
    "FileArena",
    "MappedArena",
    "PackCache",
    "StalePack",
    "filesystem",
]

# Bumped when the layout of a kept pack, or what its key covers, changes.
PACK_VERSION = 1
# Packs kept, the most recently used (each about the model file's size on disk).
KEPT_PACKS = 3
# What must be left free on the cache's filesystem beside a pack the model file's size.
_SPARE = 1 << 30
_SPOT = 4096  # bytes checksummed at each end of a buffer
_STALE_TMP_S = 3600.0  # a temporary pack file untouched this long is a stopped start's
# Filesystems another machine may change under a map (a file replaced or pruned there
# is gone here too, and a page the kernel evicted then faults): packs are not kept on
# them. Any FUSE filesystem too (fuse.sshfs, fuse.gcsfuse, ...).
_SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p", "virtiofs", "lustre",
    "beegfs", "gpfs", "afs", "ocfs2", "gfs2",
})  # fmt: skip


class StalePack(Exception):
    """A kept pack's layout is not this load's: pack from the file instead."""


def filesystem(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the filesystem `path` is (or would be) on, from Linux's mountinfo
    (the longest mount point above it); None where that cannot be read."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = -1, None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right.split():
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:
            best, kind = len(mount), right.split()[0]
    return kind


def _shared(kind: str | None) -> bool:
    return kind is not None and (kind in _SHARED_FILESYSTEMS or kind.startswith("fuse"))


def _spots(t: torch.Tensor) -> int:
    data = t.numpy()
    return zlib.crc32(data[-_SPOT:].tobytes(), zlib.crc32(data[:_SPOT].tobytes()))


class MappedArena(PackArena):
    """A PackArena over a kept pack's map: `take` gives the part the packing load took
    at the same step, packed already (`filled`)."""

    filled = True

    def __init__(self, whole: torch.Tensor, parts: list[tuple[int, int]], path: Path) -> None:
        super().__init__()
        self._whole = whole
        self._kept = parts  # (offset in the file, bytes), in packing order
        self._next = 0
        self.path = path

    def take(self, nbytes: int) -> torch.Tensor:
        if self._next >= len(self._kept) or self._kept[self._next][1] != nbytes:
            raise StalePack(f"part {self._next} of the kept pack is not {nbytes} bytes")
        offset, size = self._kept[self._next]
        self._next += 1
        return self._whole[offset : offset + size]

    def mapped_bytes(self) -> int:
        return sum(size for _, size in self._kept)

    def finish(self) -> None:
        """Raises StalePack where the load took fewer parts than the pack holds."""
        if self._next != len(self._kept):
            raise StalePack(f"the load took {self._next} of {len(self._kept)} parts")


class FileArena(PackArena):
    """A PackArena whose buffers are parts of a new file, each mapped shared at the next
    2 MiB-aligned offset, and each part's blocks allocated as it is taken (a full disk is
    an error then, not a fault as a page is first written; a chunk's unused tail takes
    no room). Where the file cannot grow, the rest is fresh memory, and `broken` says
    why (the pack is not kept)."""

    def __init__(self, fd: int, path: Path) -> None:
        super().__init__()
        self.fd = fd
        self.path = path  # the temporary file
        self._at: dict[int, int] = {}  # a mapped buffer's id -> its offset in the file
        self._end = 0
        self._spare: list[torch.Tensor] = []  # parts given from memory once broken
        self.broken = ""

    def _fail(self, e: OSError) -> None:
        self.broken = os_error(e)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if not self.broken:
            offset = -(-self._end // HUGE_PAGE) * HUGE_PAGE
            try:
                os.ftruncate(self.fd, offset + nbytes)
                m = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)  # fmt: skip
            except OSError as e:
                self._fail(e)
            else:
                with contextlib.suppress(OSError, AttributeError):
                    m.madvise(mmap.MADV_HUGEPAGE)
                out = torch.frombuffer(m, dtype=torch.uint8)  # holds the map
                self._at[id(out)] = offset
                self._end = offset + nbytes
                return out
        return super()._buffer(nbytes)

    def take(self, nbytes: int) -> torch.Tensor:
        part = super().take(nbytes)
        buffer, at, _ = self._parts[-1]
        if self.broken or id(buffer) not in self._at:
            return part
        try:
            os.posix_fallocate(self.fd, self.offset(buffer) + at, nbytes)
        except OSError as e:
            self._fail(e)
            self._spare.append(super()._buffer(nbytes))
            return self._spare[-1]
        return part

    def offset(self, buffer: torch.Tensor) -> int:
        """Where a mapped `buffer` is in the file."""
        return self._at[id(buffer)]

    def mapped_bytes(self) -> int:
        return sum(used for t, used in self.buffers() if id(t) in self._at)

    def discard(self) -> None:
        """The file gone (a load that failed): its maps stay until their tensors go."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class PackCache:
    """Packs kept under `directory` for one model file (`model_sha256`) as packed by
    this process's kernels library."""

    def __init__(self, directory: str, model_sha256: str, library: Path | None) -> None:
        self.directory = Path(directory)
        self.material: dict[str, Any] = {
            "version": PACK_VERSION,
            "model_sha256": model_sha256,
            "library": None if library is None else file_digest(library),
            "engine_source": engine_source_digest(),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "cpu": processor(),
        }
        raw = json.dumps(self.material, sort_keys=True).encode()
        self.key = hashlib.sha256(raw).hexdigest()[:32]
        self.bin = self.directory / f"{self.key}.bin"
        self.meta = self.directory / f"{self.key}.json"
        self.filesystem = filesystem(self.directory)

    def open(self) -> MappedArena | None:
        """The kept pack mapped read-only, or None (none kept, or not one to trust)."""
        if _shared(self.filesystem):
            return None
        try:
            layout = json.loads(self.meta.read_text(encoding="utf-8"))
            if layout.get("version") != PACK_VERSION or layout.get("key") != self.key:
                return None
            buffers = [(int(o), int(n), int(c)) for o, n, c in layout["buffers"]]
            parts = [(int(o), int(n)) for o, n in layout["parts"]]
            with open(self.bin, "rb") as f:
                st = os.fstat(f.fileno())
                if [st.st_size, st.st_ino, st.st_mtime_ns] != layout["identity"] or not parts:
                    return None
                mapped = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        inside = all(o + n <= st.st_size for o, n, _ in buffers)
        if not inside or any(o % PackArena.ALIGN or o + n > st.st_size for o, n in parts):
            return None
        with contextlib.suppress(OSError, AttributeError):
            mapped.madvise(mmap.MADV_HUGEPAGE)  # read from disk in 2 MiB folios, if read
        with warnings.catch_warnings():  # torch warns of a buffer it cannot write: none does
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the map
        if any(_spots(whole[o : o + n]) != c for o, n, c in buffers):
            return None
        mark_used(self.meta)  # (not the .bin: its times are its identity)
        return MappedArena(whole, parts, self.bin)

    def create(self, expected: int) -> FileArena | str:
        """An arena packing into a new file here, or why not (no room for `expected`
        bytes with _SPARE to spare, the directory cannot be written, or it is on a
        filesystem other machines share)."""
        if _shared(self.filesystem):
            return (f"the cache directory is on {self.filesystem}, which other machines may "
                    "change under a map")  # fmt: skip
        if not hasattr(os, "posix_fallocate"):
            return "this system has no posix_fallocate to reserve the file's blocks"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if free < expected + _SPARE:
                return f"{expected >> 20} MiB would leave under {_SPARE >> 30} GiB free on its disk"
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=".tmp")
        except OSError as e:
            return os_error(e)
        return FileArena(fd, Path(tmp))

    def keep(self, arena: FileArena) -> str:
        """Keep what `arena` packed (its matrices made read-only first). Returns "" or why
        it was not kept (the server serves either way)."""
        try:
            if arena.broken:
                return arena.broken
            buffers = []
            for tensor, used in arena.buffers():  # all mapped: not broken
                read_only(tensor)
                buffers.append([arena.offset(tensor), used, _spots(tensor[:used])])
            parts = [[arena.offset(t) + o, n] for t, o, n in arena.parts()]
            os.replace(arena.path, self.bin)
            st = os.fstat(arena.fd)
            layout = {
                "version": PACK_VERSION,
                "key": self.key,
                "material": self.material,
                "identity": [st.st_size, st.st_ino, st.st_mtime_ns],
                "buffers": buffers,
                "parts": parts,
            }
            keep_file(self.meta, json.dumps(layout).encode(), keep=KEPT_PACKS)
        except OSError as e:
            return os_error(e)
        finally:
            arena.discard()  # the descriptor closed, the maps kept; renamed: nothing to unlink
        self._prune()
        return ""

    def _prune(self) -> None:
        """Every .bin whose layout was pruned (keep_file keeps KEPT_PACKS layouts), and
        the temporary file of a start that stopped while packing into one (untouched for
        _STALE_TMP_S: another start may be packing into its own now), removed."""
        kept = {p.stem for p in self.directory.glob("*.json")}
        now = time.time()
        for p in self.directory.glob("*"):
            with contextlib.suppress(OSError):
                gone = p.suffix == ".bin" and p.stem not in kept
                gone |= p.suffix == ".tmp" and now - p.stat().st_mtime > _STALE_TMP_S
                if gone:
                    p.unlink()
