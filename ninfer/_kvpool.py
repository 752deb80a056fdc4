"""Accounting of KV-cache pages: a fixed pool of fixed-size pages, owned by the engine."""

from __future__ import annotations

import attrs

__all__ = ["PagePool", "pages_for"]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@attrs.define(eq=False)
class PagePool:
    """Free list of page ids 1..n_pages (page 0 is the zero padding page)."""

    n_pages: int
    page_size: int
    _free: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # Pop from the end: lowest ids first, so a light load touches little memory.
        self._free = list(range(self.n_pages, 0, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        return taken

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
