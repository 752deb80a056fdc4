"""The page pool's prefix cache: whole pages by chained digest, and the first tokens of a
page that goes on as a prompt does."""

from __future__ import annotations

from ninfer.engine._kvpool import PagePool, page_keys

S = 4


def _cache(pool: PagePool, tokens: list[int]) -> list[int]:
    """Pages holding `tokens` (whole pages), indexed and then released (cached, idle)."""
    pages = pool.allocate(len(tokens) // S)
    assert pages is not None
    keys = page_keys(tokens, S, len(pages))
    for i, (page, key) in enumerate(zip(pages, keys, strict=True)):
        pool.register(page, key, keys[i - 1] if i else b"", tokens[i * S : (i + 1) * S])
    pool.release(pages)
    return pages


def test_the_longest_page_that_goes_on_as_the_prompt_does_is_lent() -> None:
    pool = PagePool(n_pages=8, page_size=S)
    a = _cache(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    b = _cache(pool, [1, 2, 3, 4, 5, 6, 9, 9])
    first = page_keys([1, 2, 3, 4], S, 1)[0]
    assert pool.share(page_keys([1, 2, 3, 4, 5, 6, 7, 0], S, 2)) == [a[0]]
    assert pool.share_part(first, [5, 6, 7, 0]) == (a[1], 3)
    assert pool.share_part(first, [5, 6, 9]) == (b[1], 3)
    assert pool.share_part(first, [5, 0]) in ((a[1], 1), (b[1], 1))
    assert pool.share_part(first, [6]) is None  # no page after it begins so
    assert pool.share_part(b"", [2]) is None
    assert pool.share_part(b"", [1, 2]) == (a[0], 2)  # a first page, in part
    assert pool.share_part(first, []) is None


def test_a_lent_page_is_held_and_a_reclaimed_one_is_no_longer_offered() -> None:
    pool = PagePool(n_pages=2, page_size=S)
    (page,) = _cache(pool, [1, 2, 3, 4])
    assert pool.free == 2
    assert pool.share_part(b"", [1, 2, 3]) == (page, 3)
    assert pool.free == 1  # held while its rows are copied
    pool.release([page])
    assert pool.allocate(2) is not None  # takes the cached page too
    assert pool.share_part(b"", [1, 2, 3]) is None
    assert pool.cached == 0


def test_keys_go_on_from_the_known_ones() -> None:
    tokens = list(range(3, 40))
    whole = page_keys(tokens, S, 9)
    assert page_keys(tokens, S, 9, known=whole[:4]) == whole
    assert page_keys(tokens, S, 2, known=whole[:4]) == whole[:2]


def test_an_int8_cache_keeps_each_row_to_half_a_step_of_its_scale() -> None:
    """--kv-dtype int8: each position's head row is stored as int8 with its own scale
    (max |x| / 127) and read back as float32 within half a step of the scale; a row of
    zeros stays zeros; copies and clears carry the scales with the values."""
    import torch

    from ninfer.engine._gguf import ModelArgs
    from ninfer.engine._kvpool import KVPages

    args = ModelArgs(architecture="llama", n_layers=2, dim=32, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=8, vocab_size=8, context_length=64, rope_base=1e4,
                     norm_eps=1e-5)  # fmt: skip
    kv = KVPages.allocate(args, n_pages=4, page_size=S, dtype=torch.float32, device="cpu",
                          kv_dtype="int8")  # fmt: skip
    assert kv.quantized
    assert kv.k.dtype == torch.int8
    assert KVPages.bytes_per_token(args, torch.float32, "int8") == 2 * 2 * 2 * (16 + 4)
    assert KVPages.bytes_per_token(args, torch.float32) == 2 * 2 * 2 * 16 * 4
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 2, 16, generator=gen) * torch.tensor([0.01, 100.0]).view(1, 1, 2, 1)
    v = torch.randn(1, 3, 2, 16, generator=gen)
    v[0, 1] = 0.0  # a row of zeros
    kv.zero_pages([1, 2])
    slots = kv.slots(torch.tensor([[1, 1, 2]]), torch.tensor([[0, 1, 0]]))
    kv.write(0, slots, k, v)
    page_table = torch.tensor([[1, 2]])
    keys, values = kv.gather(0, kv.blocks(page_table), 1)  # (G, P*S, D)
    got_k = keys.view(2, 2, S, 16)  # (head, page, offset, D)
    got_v = values.view(2, 2, S, 16)
    for t, (page, off) in enumerate(((0, 0), (0, 1), (1, 0))):
        for head in range(2):
            step = k[0, t, head].abs().max() / 127
            assert (got_k[head, page, off] - k[0, t, head]).abs().max() <= step / 2 + 1e-6
            vstep = v[0, t, head].abs().max() / 127
            assert (got_v[head, page, off] - v[0, t, head]).abs().max() <= vstep / 2 + 1e-6
    assert torch.equal(got_v[:, 0, 1], torch.zeros(2, 16))
    kv.copy_rows(1, 3, 2)  # page 1's two rows into page 3
    copied, _ = kv.gather(0, kv.blocks(torch.tensor([[3]])), 1)
    assert torch.equal(copied.view(2, S, 16)[:, :2], got_k[:, 0, :2])
    kv.clear_slots([1], [0])
    cleared, _ = kv.gather(0, kv.blocks(page_table), 1)
    assert torch.equal(cleared.view(2, 2, S, 16)[:, 0, 0], torch.zeros(2, 16))
    assert torch.equal(cleared.view(2, 2, S, 16)[:, 0, 1], got_k[:, 0, 1])


def test_a_float16_cache_holds_each_key_and_value_as_its_nearest_half() -> None:
    """--kv-dtype float16 (auto's choice beside float32 activations): half float32's bytes
    a token; each key and value is stored as the nearest half (ties to even: numpy's own
    conversion agrees on a tie, a subnormal and a value past the largest half) and read
    back as float32 of exactly that value; copies carry them."""
    import numpy as np
    import torch

    from ninfer.engine._gguf import ModelArgs
    from ninfer.engine._kvpool import KVPages

    args = ModelArgs(architecture="llama", n_layers=2, dim=32, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=8, vocab_size=8, context_length=64, rope_base=1e4,
                     norm_eps=1e-5)  # fmt: skip
    kv = KVPages.allocate(args, n_pages=4, page_size=S, dtype=torch.float32, device="cpu",
                          kv_dtype="float16")  # fmt: skip
    assert kv.k.dtype == kv.v.dtype == torch.float16
    assert not kv.quantized
    assert KVPages.bytes_per_token(args, torch.float32, "float16") * 2 == (
        KVPages.bytes_per_token(args, torch.float32, "float32")
    )
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 2, 16, generator=gen) * 3
    v = torch.randn(1, 3, 2, 16, generator=gen)
    # a tie (1 + 2^-11 lies halfway between two halves: to the even one, 1.0), a
    # subnormal half, and past the largest half (65504): infinity
    k[0, 0, 0, :3] = torch.tensor([1 + 2.0**-11, 3e-6, 70000.0])
    kv.zero_pages([1, 2, 3])
    slots = kv.slots(torch.tensor([[1, 1, 2]]), torch.tensor([[0, 1, 0]]))
    kv.write(0, slots, k, v)
    keys, values = kv.gather(0, kv.blocks(torch.tensor([[1, 2]])), 1)  # (G, P*S, D)
    assert keys.dtype == values.dtype == torch.float32
    for got, want in ((keys, k), (values, v)):
        with np.errstate(over="ignore"):  # 70000: infinity, as meant
            halves = torch.from_numpy(want.numpy().astype(np.float16)).float()
        pages = got.view(2, 2, S, 16)  # (head, page, offset, D)
        for t, (page, off) in enumerate(((0, 0), (0, 1), (1, 0))):
            assert torch.equal(pages[:, page, off], halves[0, t])
    assert keys.view(2, 2, S, 16)[0, 0, 0, :3].tolist() == [1.0, 2.98023223876953125e-06,
                                                            float("inf")]  # fmt: skip
    kv.copy_rows(1, 3, 2)
    copied, _ = kv.gather(0, kv.blocks(torch.tensor([[3]])), 1)
    assert torch.equal(copied.view(2, S, 16)[:, :2], keys.view(2, 2, S, 16)[:, 0, :2])


def test_a_cached_prefix_never_lends_the_page_of_the_prompts_last_token() -> None:
    """The prefix cache's policy, in the pool: whole cached pages of the prompt, never
    the one holding its last token (its logits are the first output), then the cached
    page that goes on as the prompt does, with how many of its rows."""
    pool = PagePool(n_pages=8, page_size=S)
    cached = _cache(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # ends on a page: its second page holds the last token
    shared, part = pool.cached_prefix(prompt, page_keys(prompt, S, 2))
    assert shared == [cached[0]]
    assert part == (cached[1], 3)  # 5, 6, 7: all but the last token
    pool.release([*shared, part[0]])
    longer = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    shared, part = pool.cached_prefix(longer, page_keys(longer, S, 2))
    assert (shared, part) == (cached, None)
    pool.release(shared)
    other = [9, 9, 9, 9, 9]
    assert pool.cached_prefix(other, page_keys(other, S, 1)) == ([], None)
    fresh = pool.allocate(2)
    assert fresh is not None
    pool.index(fresh, [9, 9, 9, 9, 8, 8, 8, 8], page_keys([9, 9, 9, 9, 8, 8, 8, 8], S, 2))
    pool.release(fresh)
    shared, _part = pool.cached_prefix(other, page_keys(other, S, 1))
    assert shared == [fresh[0]]


def test_never_used_pages_are_taken_only_within_the_memory_measured() -> None:
    """With `room` (the pages the machine has memory for now), a pool hands out pages it
    never touched only within it; past it, only pages it touched before, as if it were
    that size. The room is read again whenever never-used pages are wanted (here at
    every call; at most every `room_every_s`)."""
    machine = [3]  # pages' worth of memory beside the pool's resident pages
    readings = []

    def measure() -> int:
        readings.append(machine[0] - pool.touched)
        return readings[-1]

    pool = PagePool(n_pages=10, page_size=S, room=measure, room_every_s=0.0)
    first = pool.allocate(2)
    assert first == [1, 2]
    assert pool.touched == 2
    assert readings == [3]
    assert pool.free == 1
    assert pool.short
    assert pool.allocate(2) is None  # measured again (still one), nothing taken
    assert readings == [3, 1]
    assert pool.used == 2
    machine[0] = 2  # another process took the memory
    pool.release(first)
    again = pool.allocate(2)  # the touched pages come back first: no reading needed
    assert again is not None
    assert sorted(again) == [1, 2]
    assert readings == [3, 1]
    assert pool.allocate(1) is None  # read again: the one allowed before is gone
    assert readings == [3, 1, 0]
    assert pool.touched == 2
    assert pool.free == 0
    machine[0] = 100  # the memory is back
    assert pool.allocate(8) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert not pool.short


def test_cached_pages_are_reclaimed_when_the_memory_allows_no_new_ones() -> None:
    pool = PagePool(n_pages=8, page_size=S, room=lambda: 2 - pool.touched, room_every_s=0.0)
    cached = _cache(pool, [1, 2, 3, 4, 5, 6, 7, 8])  # pages 1 and 2, idle in the cache
    assert pool.cached == 2
    assert pool.free == 2
    taken = pool.allocate(2)
    assert taken is not None
    assert sorted(taken) == cached
    assert pool.cached == 0
    assert pool.touched == 2


def test_a_spare_is_kept_free_for_others() -> None:
    pool = PagePool(n_pages=8, page_size=S, room=lambda: 4 - pool.touched, room_every_s=0.0)
    assert pool.allocate(2, spare=3) is None  # 4 allowed: 2 taken would leave 2 < 3
    assert pool.allocate(1, spare=3) == [1]
    assert pool.allocate(8) is None
    assert pool.allocate(3) == [2, 3, 4]


def test_without_room_every_page_is_free() -> None:
    pool = PagePool(n_pages=4, page_size=S)
    assert pool.free == 4
    assert not pool.short
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.touched == 4
