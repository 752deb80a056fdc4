"""Accounting of KV-cache pages: a fixed pool of fixed-size pages, owned by the engine,
with a prefix cache of full pages.

A page full of a request's tokens (its prompt's, once prefilled; its output's too, once
it has finished) is never written again; it is indexed by a digest of every token up
to its end, and a later prompt that starts with the same tokens shares it instead of
computing it again (reference counts per page). Where the shared pages end, an indexed
page that goes on as the prompt does for some tokens lends them: their keys and values
are copied into the prompt's own page (`share_part`). A page no request holds any more
stays cached until its memory is needed: it counts as free, and `allocate` takes the
least recently used of those after the released and never-used ones.

A pool's memory is reserved when it is made, and becomes resident page by page as
pages are first written. Where other processes may take the memory meanwhile (the
CPU), a pool can be given `room`: how many more pages the machine has memory for now.
A never-used page is then handed out only within the room measured (read again before
never-used pages are taken, at most every `room_every_s`); past it the pool gives out
only pages it has touched before, as if it were that size: it never pushes the machine
into swap or the OOM killer for pages it has not touched yet.

A prompt prefilled from the end of its cached part computes its rest as a chunk of
other rows than the whole prompt would; every row is computed the same in any chunk
(row-invariant matmuls, attention in fixed key blocks), so it gets the bits it gets
computed whole (docs/engine.md, "Prefix cache").
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs

__all__ = ["PagePool", "page_keys", "pages_for"]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def page_keys(
    tokens: Sequence[int], page_size: int, pages: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The cache keys of the first `pages` full pages of `tokens`: a chained digest, so a
    page's key stands for every token before its end. `known`: keys of the first pages
    of the same tokens, computed before (they are taken, and the chain goes on)."""
    keys = list(known[:pages])
    digest = keys[-1] if keys else b""
    for i in range(len(keys), pages):
        block = tokens[i * page_size : (i + 1) * page_size]
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in block))
        digest = h.digest()
        keys.append(digest)
    return keys


@attrs.define(eq=False)
class PagePool:
    """Page ids 1..n_pages (page 0 is the zero padding page): free, held (with a reference
    count), or cached (held by nobody, still indexed, reclaimed last)."""

    n_pages: int
    page_size: int
    # How many never-used pages the machine has memory for now (None: no limit).
    room: Callable[[], int] | None = None
    # The least seconds between two readings of `room`.
    room_every_s: float = 0.1
    _free: list[int] = attrs.field(init=False)
    _touched: int = attrs.field(init=False, default=0)  # page ids 1.._touched were used
    _allowed: int = attrs.field(init=False, default=0)  # never-used pages `room` allows
    _measured: float | None = attrs.field(init=False, default=None)  # when, monotonic
    _refs: dict[int, int] = attrs.field(init=False, factory=dict)
    _index: dict[bytes, int] = attrs.field(init=False, factory=dict)
    _key_of: dict[int, bytes] = attrs.field(init=False, factory=dict)
    _idle: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict)
    # Indexed pages by what comes before them and their first token, with their tokens:
    # where a prompt's shared pages end, the pages that may go on as it does.
    _next: dict[tuple[bytes, int], list[int]] = attrs.field(init=False, factory=dict)
    _tokens_of: dict[int, tuple[bytes, tuple[int, ...]]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        # Pop from the end: lowest ids first, so a light load touches little memory.
        self._free = list(range(self.n_pages, 0, -1))

    @property
    def free(self) -> int:
        """Pages `allocate` can hand out: never used (within the room last measured),
        released, or cached but idle."""
        return len(self._free) - self._untouched + self._fresh + len(self._idle)

    @property
    def used(self) -> int:
        """Pages held by requests."""
        return len(self._refs)

    @property
    def cached(self) -> int:
        return len(self._index)

    @property
    def short(self) -> bool:
        """Whether never-used pages are left that the memory does not allow now."""
        return self._fresh < self._untouched

    @property
    def touched(self) -> int:
        """Pages ever handed out: the pool's resident part."""
        return self._touched

    @property
    def _untouched(self) -> int:
        return self.n_pages - self._touched

    @property
    def _fresh(self) -> int:
        """Never-used pages `allocate` may hand out now."""
        return self._untouched if self.room is None else min(self._untouched, self._allowed)

    def _measure(self, need: int) -> None:
        """Read the room again before `need` never-used pages are taken, at most every
        `room_every_s` (memory others took since is seen within that time)."""
        if self.room is None or need <= 0 or self._touched == self.n_pages:
            return
        now = time.monotonic()
        if self._measured is None or now - self._measured >= self.room_every_s:
            self._allowed, self._measured = max(0, self.room()), now

    def allocate(self, n: int, *, spare: int = 0) -> list[int] | None:
        """n fresh pages (contents undefined), or None (and nothing taken) when fewer
        than n + `spare` are free. Pages used before and released come first, then
        never-used ones, and cached idle pages are reclaimed, least recently used first,
        only when those run out."""
        reused = len(self._free) - self._untouched
        self._measure(n - reused)  # never-used pages come before cached ones
        if n + spare > self.free:
            return None
        taken = []
        for _ in range(n):
            # Released pages are on top of the free list, never-used ones below them
            # in ascending order: a light load touches little memory.
            if self._free and (self._free[-1] <= self._touched or self._fresh > 0):
                page = self._free.pop()
                if page > self._touched:
                    self._touched = page
                    self._allowed -= 1
            else:
                page, _ = self._idle.popitem(last=False)
                self._unindex(page)
            self._refs[page] = 1
            taken.append(page)
        return taken

    def share(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached prefix of `keys`, each now held once more."""
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                break
            self._hold(page)
            pages.append(page)
        return pages

    def share_part(self, before: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The indexed page that follows the pages keyed up to `before` (b"" for a first
        page) and begins with the longest run of `tokens`: (page, how many of them),
        the page now held once more (release it when its rows are copied); None when
        none begins with tokens[0]."""
        if not tokens:
            return None
        best, length = 0, 0
        for page in self._next.get((before, tokens[0]), ()):
            theirs = self._tokens_of[page][1]
            n = 0
            for mine, other in zip(tokens, theirs, strict=False):
                if mine != other:
                    break
                n += 1
            if n > length:
                best, length = page, n
        if not length:
            return None
        self._hold(best)
        return best, length

    def register(self, page: int, key: bytes, before: bytes, tokens: Sequence[int]) -> None:
        """Index a held page whose tokens are complete and final (a full page): `key` its
        chained digest, `before` the previous page's (b"" for a first page), `tokens`
        its own."""
        if key in self._index or page in self._key_of:
            return  # the same prefix computed twice at once: the first copy serves
        self._index[key] = page
        self._key_of[page] = key
        self._tokens_of[page] = (before, tuple(tokens))
        self._next.setdefault((before, tokens[0]), []).append(page)

    def index(self, pages: Sequence[int], tokens: Sequence[int], keys: Sequence[bytes]) -> None:
        """Put held `pages` of `tokens` (whole pages whose keys and values are final) in
        the prefix cache, `keys` their chained digests (`page_keys`)."""
        S = self.page_size
        for i, (page, key) in enumerate(zip(pages, keys, strict=False)):
            self.register(page, key, keys[i - 1] if i else b"", tokens[i * S : (i + 1) * S])

    def cached_prefix(
        self, prompt: Sequence[int], keys: Sequence[bytes]
    ) -> tuple[list[int], tuple[int, int] | None]:
        """What the cache holds of `prompt` (`keys`: its whole pages' digests), each page
        now held once more: the pages of its longest cached prefix, whole pages only and
        never the one holding its last token (whose logits are the first output); then
        the cached page that goes on as the prompt does (a common system prompt rarely
        ends on a page) with how many of its rows do, or None. Release that page once
        its rows are copied into the prompt's own."""
        S = self.page_size
        shared = self.share(keys[: (len(prompt) - 1) // S])
        start = len(shared) * S
        before = keys[len(shared) - 1] if shared else b""
        part = self.share_part(before, prompt[start : min(start + S, len(prompt) - 1)])
        return shared, part

    def _unindex(self, page: int) -> None:
        del self._index[self._key_of.pop(page)]
        before, tokens = self._tokens_of.pop(page)
        following = self._next[(before, tokens[0])]
        following.remove(page)
        if not following:
            del self._next[(before, tokens[0])]

    def _hold(self, page: int) -> None:
        if self._refs.get(page, 0) == 0:
            del self._idle[page]
        self._refs[page] = self._refs.get(page, 0) + 1

    def release(self, pages: list[int]) -> None:
        """Let go of one hold on each page; a page nobody holds is free again, or cached
        (and reclaimable) when indexed."""
        for page in reversed(pages):
            refs = self._refs[page] - 1
            if refs:
                self._refs[page] = refs
                continue
            del self._refs[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)
