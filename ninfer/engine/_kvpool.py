"""The KV cache's pages: their tensors (`KVPages`: every layer's keys and values, page
by page, float or int8) and their accounting (`PagePool`: a fixed pool of fixed-size
pages, owned by the engine, with a prefix cache of full pages).

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
import torch

from ninfer.engine._contract import pages_for
from ninfer.engine._gguf import ModelArgs

__all__ = ["KVPages", "PagePool", "page_keys", "pages_for", "reserve_prompt"]


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


# --kv-dtype int8: keys and values as 8-bit integers with one float32 scale per position
# and head (llama.cpp's q8_0 cache, with a block of one head's row).
_INT8_MAX = 127.0


@attrs.define(eq=False)
class KVPages:
    """The key/value page pool: (layers, pages, kv_heads, page_size, head_dim) each. A
    page holds each kv head's keys as one block, so that one `index_select` gathers a
    batch's keys in attention's own layout, (rows x kv heads, keys, head_dim), with no
    copy after it.

    Page 0 is an always-zero padding page; real pages are 1..n_pages; page
    n_pages + 1 is scratch, written by the padding rows of a decode batch.

    As float16 (`--kv-dtype float16` beside float32 activations), each key and value is
    stored as the nearest half (ties to even) and read back as the float of that value:
    half the memory, every sum still float32, a row's numbers its own.

    Quantized (int8), each position's head row is stored as int8 with its scale
    (max |x| / 127, a (layers, pages, kv_heads, page_size, 1) float32 tensor each for
    keys and values), and gathered back to float32: row by row, so a row's keys do not
    depend on what else is in the batch.

    For the native layers (`keys_transposed`) the keys are (layers, pages, kv_heads,
    head_dim, page_size): each head's page transposed, so that the native attention reads
    one element of 16 keys as one vector (csrc/api.h); the torch path's `write` and
    `gather` do not read that layout.
    """

    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    k_scale: torch.Tensor | None = None  # int8 only
    v_scale: torch.Tensor | None = None
    keys_transposed: bool = False
    # Each layer's keys and values as views made once: (pages, kv heads, page size,
    # head dim) to write into, (pages * kv heads, page size, head dim) blocks to gather
    # (and, int8, the scales' likewise).
    _layers: list[tuple[torch.Tensor, ...]] = attrs.field(init=False)
    _scales: list[tuple[torch.Tensor, ...]] = attrs.field(init=False)
    _heads: torch.Tensor = attrs.field(init=False)  # 0..kv heads - 1

    def __attrs_post_init__(self) -> None:
        _, pages, heads, size, dim = self.v.shape  # the keys' last two may be transposed
        self._heads = torch.arange(heads, device=self.k.device)
        self._layers = [
            (k, v, k.view(pages * heads, size, dim), v.view(pages * heads, size, dim))
            for k, v in zip(self.k.unbind(0), self.v.unbind(0), strict=True)
        ]
        self._scales = []
        if self.k_scale is not None and self.v_scale is not None:
            self._scales = [
                (k, v, k.view(pages * heads, size, 1), v.view(pages * heads, size, 1))
                for k, v in zip(self.k_scale.unbind(0), self.v_scale.unbind(0), strict=True)
            ]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @classmethod
    def allocate(
        cls,
        args: ModelArgs,
        *,
        n_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kv_dtype: str = "auto",
        keys_transposed: bool = False,
    ) -> KVPages:
        shape = (args.n_layers, n_pages + 2, args.n_kv_heads, page_size, args.head_dim)
        quantized = kv_dtype == "int8"
        store = _store_dtype(dtype, kv_dtype)
        # empty, not zeros: pages are zeroed when handed out (`zero_pages`), so memory
        # for pages never used is never touched and does not count in RSS.
        k_shape = (*shape[:3], args.head_dim, page_size) if keys_transposed else shape
        k = torch.empty(k_shape, dtype=store, device=device)
        v = torch.empty(shape, dtype=store, device=device)
        scales: tuple[torch.Tensor | None, ...] = (None, None)
        if quantized:
            scale_shape = (*shape[:-1], 1)
            scales = tuple(torch.empty(scale_shape, device=device) for _ in range(2))
        kv = cls(k=k, v=v, page_size=page_size, k_scale=scales[0], v_scale=scales[1],
                 keys_transposed=keys_transposed)  # fmt: skip
        # The padding page and the scratch page are zeroed now: garbage there (a NaN
        # among it) must never reach a padding row's output, however masked.
        kv.zero_pages([0, n_pages + 1])
        return kv

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """Memory one token's keys and values take, every layer (int8: a byte a number
        and a float32 scale a head row)."""
        rows = 2 * args.n_layers * args.n_kv_heads
        if kv_dtype == "int8":
            return rows * (args.head_dim + 4)
        itemsize = torch.empty((), dtype=_store_dtype(dtype, kv_dtype)).element_size()
        return rows * args.head_dim * itemsize

    @property
    def n_pages(self) -> int:
        return int(self.k.shape[1]) - 2

    @property
    def scratch_page(self) -> int:
        return int(self.k.shape[1]) - 1

    def slots(self, page: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Where (B, T) new positions' keys go, every kv head: (B, T, G) indices."""
        B, T = page.shape
        return (page.view(B, T, 1), self._heads.view(1, 1, -1), offset.view(B, T, 1))

    def write(
        self, layer: int, slots: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """A layer's new keys and values (B, T, G, D) at `slots`."""
        assert not self.keys_transposed, "the native layers write their own keys"
        keys, values, _, _ = self._layers[layer]
        if not self._scales:  # float16: each rounded to the nearest half
            keys.index_put_(slots, k.to(keys.dtype))
            values.index_put_(slots, v.to(values.dtype))
            return
        k_scales, v_scales, _, _ = self._scales[layer]
        for rows, store, scales in ((k, keys, k_scales), (v, values, v_scales)):
            q, scale = _quantize(rows)
            store.index_put_(slots, q)
            scales.index_put_(slots, scale)

    def blocks(self, page_table: torch.Tensor) -> torch.Tensor:
        """The blocks rows' keys are in, (B * G * P,) in (row, head, page) order:
        page * G + head."""
        B, P = page_table.shape
        G = self._heads.numel()
        return (page_table.view(B, 1, P) * G + self._heads.view(1, G, 1)).view(-1)

    def gather(self, layer: int, blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """A layer's keys and values at `blocks` (from `blocks`, for `rows` rows): each
        (rows * kv heads, pages * page size, head dim), attention's layout (float16 and
        int8: as float32)."""
        assert not self.keys_transposed, "the native layers read their own keys"
        _, _, k_blocks, v_blocks = self._layers[layer]
        dim = k_blocks.shape[-1]
        groups = rows * self._heads.numel()
        k = k_blocks.index_select(0, blocks).view(groups, -1, dim)
        v = v_blocks.index_select(0, blocks).view(groups, -1, dim)
        if not self._scales:
            if k.dtype == torch.float16:  # every half is exactly a float
                return k.float(), v.float()
            return k, v
        _, _, k_scales, v_scales = self._scales[layer]
        k_scale = k_scales.index_select(0, blocks).view(groups, -1, 1)
        v_scale = v_scales.index_select(0, blocks).view(groups, -1, 1)
        return k.float() * k_scale, v.float() * v_scale

    def _tensors(self) -> list[torch.Tensor]:
        out = [self.k, self.v]
        if self.k_scale is not None and self.v_scale is not None:
            out += [self.k_scale, self.v_scale]
        return out

    def clear_slots(self, pages: Sequence[int], offsets: Sequence[int]) -> None:
        """Every layer's keys and values at (page, offset) slots back to zeros: the
        positions a rejected draft wrote, so that the pool holds what plain steps leave."""
        if not pages:
            return
        page = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        offset = torch.tensor(offsets, dtype=torch.long, device=self.k.device)
        for t in self._tensors():
            self._by_slot(t)[:, page, :, offset] = 0

    def copy_rows(self, source: int, target: int, rows: int) -> None:
        """Every layer's keys and values of the first `rows` slots of page `source`
        into page `target`."""
        for t in self._tensors():
            s = self._by_slot(t)
            s[:, target, :, :rows] = s[:, source, :, :rows]

    def saved(self) -> list[torch.Tensor]:
        """A copy of every page, for `restore`."""
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Every page back to what `saved` copied."""
        for t, s in zip(self._tensors(), saved, strict=True):
            t.copy_(s)

    def _by_slot(self, t: torch.Tensor) -> torch.Tensor:
        """One of the pool's tensors with a page's slots as its fourth axis: a view of the
        transposed keys (layers, pages, kv heads, slots, head dim), the others as they are."""
        return t.transpose(3, 4) if t is self.k and self.keys_transposed else t

    def zero_pages(self, pages: list[int]) -> None:
        idx = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        for t in self._tensors():
            t.index_fill_(1, idx, 0)


def _store_dtype(dtype: torch.dtype, kv_dtype: str) -> torch.dtype:
    """What a pool of `kv_dtype` (a resolved --kv-dtype, or auto: the activations'
    `dtype`) stores each number as."""
    if kv_dtype == "int8":
        return torch.int8
    if kv_dtype == "float16":
        return torch.float16
    if kv_dtype == "float32":
        return torch.float32
    return dtype


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, G, D) rows as int8 and their float32 scales (B, T, G, 1): each row on its
    own, symmetric, max |x| / 127 (a row of zeros: scale 0)."""
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _INT8_MAX
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp_(-_INT8_MAX, _INT8_MAX)
    return q.to(torch.int8), scale


def reserve_prompt(
    pool: PagePool,
    kv: KVPages,
    prompt: Sequence[int],
    keys: Sequence[bytes],
    pages: int,
    *,
    share: bool,
) -> tuple[list[int], int] | None:
    """A prompt's `pages` (its whole prompt and the output reserved for it), and how
    many of its tokens are in them already: with `share`, the pages of its longest
    cached prefix are shared (`keys`: its whole pages' digests) and the rows of a
    cached page that goes on as the prompt does are copied into its own first fresh
    page, which is zeroed first; the caller zeroes the other fresh pages before it
    writes them (`Engine._zero_ahead`: pass by pass). None, and nothing held, when the
    pool cannot give the fresh ones."""
    shared: list[int] = []
    part = None
    if share:
        shared, part = pool.cached_prefix(prompt, keys)
    fresh = pool.allocate(pages - len(shared))
    if fresh is None:
        pool.release(shared + ([part[0]] if part else []))
        return None
    prefilled = len(shared) * pool.page_size
    if part:  # its rows copied into this prompt's own page, which goes on from there
        kv.zero_pages(fresh[:1])
        kv.copy_rows(part[0], fresh[0], part[1])
        pool.release([part[0]])
        prefilled += part[1]
    return shared + fresh, prefilled
