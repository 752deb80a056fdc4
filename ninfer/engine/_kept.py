"""Small files kept between starts under the cache directory (`_checkcache`'s verdicts,
`_gguf`'s digests, `_tokenizer`'s merge orders): each written whole, the least recently
used pruned."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["keep_file", "mark_used", "os_error"]


def keep_file(path: Path, data: bytes, *, keep: int) -> None:
    """`data` written to `path` (a temporary file renamed over it: a reader sees the whole
    file or none, never part), then all but the `keep` most recently used files of its
    directory with its suffix removed. Raises OSError where the directory cannot be
    written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # gone already once renamed
    kept = []
    for p in path.parent.glob(f"*{path.suffix}"):
        with contextlib.suppress(OSError):
            kept.append((p.stat().st_mtime, p))
    kept.sort(reverse=True)
    for _, old in kept[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()


def mark_used(path: Path) -> None:
    """`path` marked as just used (its modification time), the last to be pruned."""
    with contextlib.suppress(OSError):
        os.utime(path)


def os_error(e: OSError) -> str:
    """Why a kept file could not be written or read, in a line (the console's)."""
    return f"{type(e).__name__}: {e.strerror or e}"
