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
