"""ninfer's native kernels (ninfer/engine/csrc) against float64 references of the file's
values, and against themselves: each operator gives the same bits in its plain, AVX2 and
AVX-512 builds (where this CPU runs them), for any number of rows, threads or queries
sharing a call; packing keeps every value the file stores, exactly."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import HANG_GUARD_S
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine import _native
from ninfer.engine._contract import SamplingParams
from ninfer.engine._kernels import ISAS, build_kernels, load_kernels
from ninfer.engine._kvpool import KVPages
from ninfer.engine._native import Packed
from ninfer.engine._sampling import (
    RowSampler,
    native_sample,
    native_top_k_ids,
    native_top_p_kept,
    near_reference,
    top_k_ids,
    top_p_kept,
)

OPS: Any = None


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Iterator[None]:
    """The library as ./dev.sh builds it (a failed build fails here, where a compiler
    is found: the suite never passes by skipping the kernels)."""
    global OPS
    built = build_kernels(None, progress=lambda _m: None)
    assert built.path is not None, built.reason
    load_kernels(built.path)
    OPS = torch.ops.ninfer
    OPS.configure("default", 1, 100)
    yield
    OPS.configure(_best_isa(), 2, 100)


def _isas() -> list[str]:
    """The builds this CPU can run."""
    return [isa for isa in ISAS if bool(torch.ops.ninfer.supports(isa))]


def _best_isa() -> str:
    return _isas()[-1]


QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# K-quant block sizes and where each block's float16 scales sit (llama.cpp's structs).
K_QUANTS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
            "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # fmt: skip
DENSE = ["F32", "F16", "BF16"]
TYPES = QUANTIZED + sorted(K_QUANTS) + DENSE


def raw_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor of `kind` as a file stores it, (rows, bytes a row) uint8, and its values
    by the `gguf` package's reference dequantizer (float32, (rows, cols))."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[kind]
    if kind in K_QUANTS:  # random blocks: any bit pattern is valid once its scales are
        size, f16_at = K_QUANTS[kind]
        blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
        for at in f16_at:
            scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
            blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
        raw = blocks.reshape(rows, -1)
    else:
        data = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
        if kind == "F32":
            raw = data.view(np.uint8)
        elif kind == "F16":
            raw = data.astype(np.float16).view(np.uint8)
        else:
            raw = gguf.quants.quantize(data, t)
    values = gguf.quants.dequantize(raw, t).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), values


def pack(parts: list[tuple[str, torch.Tensor]], cols: int) -> Packed:
    kinds = [k for k, _ in parts]
    fmt = int(OPS.pack_format(kinds))
    data = OPS.pack([r for _, r in parts], kinds, cols, fmt)
    return Packed(data, fmt, sum(int(r.shape[0]) for _, r in parts), cols, tuple(kinds))


def _rel(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's |fast - ref| / |ref| (ref float64)."""
    return float(((fast.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


@pytest.mark.parametrize("kind", TYPES)
def test_packing_keeps_every_value_of_the_file(kind: str) -> None:
    """Every value of a packed matrix (rows of odd count: a panel half full) is the
    `gguf` package's reference value, bit for bit, in every build."""
    raw, values = raw_tensor(kind, 37, 512)
    m = pack([(kind, raw)], 512)
    for isa in _isas():
        OPS.configure(isa, 1, 100)
        np.testing.assert_array_equal(m.rows(torch.arange(37)).numpy(), values)


@pytest.mark.parametrize("kind", TYPES)
def test_a_panel_packs_to_the_same_bytes_whole_or_a_row_at_a_time(kind: str) -> None:
    """A panel of one tensor's rows is packed whole (Q4_K straight from the file's blocks,
    other quantized types staged a panel at a time), a panel two tensors of a stack share
    a row at a time: each panel of a 64-row matrix, packed the second way (the tensor
    split 8 rows into it), is byte for byte what it is the first way; and the last panel
    of a matrix part empty does not hold what its memory held before."""
    raw, _ = raw_tensor(kind, 64, 512, seed=5)
    whole = pack([(kind, raw)], 512).data
    per = whole.numel() // 4
    for p in range(4):
        cut = 16 * p + 8
        split = pack([(kind, raw[:cut]), (kind, raw[cut:])], 512).data
        assert torch.equal(split, whole), (kind, p)
    # the last panel of 56 rows, packed where freed memory held all ones, then all zeros
    # (a block of this size is reused): the lanes it has no rows for are not left as found
    shorts = []
    for fill in (255, 0):
        junk = torch.full((whole.numel(),), fill, dtype=torch.uint8)
        del junk
        shorts.append(pack([(kind, raw[:56])], 512).data)
    assert torch.equal(shorts[0][: 3 * per], whole[: 3 * per])
    assert torch.equal(shorts[0], shorts[1])


def test_the_arena_packs_each_matrix_as_a_buffer_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Matrices packed side by side in an arena's chunk (every type, some of odd row
    counts) are byte for byte what each packs to alone, each 64-byte aligned and
    computing the same products; a matrix of half a chunk or more gets a buffer of its
    own, and a chunk too full for the next matrix is followed by a new one."""
    monkeypatch.setattr(_native.PackArena, "CHUNK", 96 << 10)
    arena = _native.PackArena()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    bases = []
    for i, kind in enumerate(TYPES):
        raw, _ = raw_tensor(kind, 16 + 7 * (i % 3), 512, seed=i)
        fmt = int(OPS.pack_format([kind]))
        alone = OPS.pack([raw], [kind], 512, fmt)
        part = arena.take(int(OPS.packed_size(fmt, raw.shape[0], 512)))
        OPS.pack_into([raw], [kind], 512, fmt, part)
        assert torch.equal(part, alone), kind
        assert part.data_ptr() % 64 == 0
        n = int(raw.shape[0])
        both = Packed(part, fmt, n, 512, (kind,)), Packed(alone, fmt, n, 512, (kind,))
        assert torch.equal(both[0](x), both[1](x)), kind
        bases.append(part.untyped_storage().data_ptr())
    assert 1 < len(set(bases)) < len(bases)  # several matrices a chunk, several chunks
    big = arena.take(_native.PackArena.CHUNK // 2)
    assert big.untyped_storage().nbytes() == _native.PackArena.CHUNK // 2


@pytest.mark.parametrize("kind", TYPES)
def test_a_matmul_is_float64_close_and_the_same_bits_everywhere(kind: str) -> None:
    """x W^T within 2e-6 of float64 of the file's values, and the same bits in every
    build, at every row count (a row alone, in 2..17 rows, anywhere among 64) and every
    thread count."""
    raw, values = raw_tensor(kind, 96 + 5, 512, seed=3)
    m = pack([(kind, raw)], 512)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ torch.from_numpy(values).double().T
    OPS.configure("default", 1, 100)
    whole = m(x)
    assert _rel(whole, ref) < 2e-6
    for isa in _isas():
        for threads in (1, 2, 3):
            OPS.configure(isa, threads, 100)
            assert torch.equal(m(x), whole), (isa, threads)
            for rows in (*range(1, 18), 33):
                for start in (0, 7):
                    part = m(x[start : start + rows])
                    assert torch.equal(part, whole[start : start + rows]), (isa, rows, start)


@pytest.mark.parametrize(
    ("kind", "outputs", "k", "starts", "middle"),
    [
        # 512 KiB of rows a tile: 60 (AVX-512) or 64 rows of 2,048 inputs
        ("Q4_K", 40, 2048, (0, 59, 60, 63, 64, 119, 120, 149), (50, 130)),
        # four row groups a tile, past 512 KiB: 24 (AVX-512's groups of 6) or 16 rows of
        # 8,192 inputs
        ("Q6_K", 24, 8192, (0, 15, 16, 23, 24, 47, 48, 59), (10, 50)),
    ],
)
def test_rows_beyond_one_tile_are_the_same_bits(
    kind: str, outputs: int, k: int, starts: tuple[int, ...], middle: tuple[int, int]
) -> None:
    """A product of more rows than one tile of x (the kernels take 512 KiB of rows at a
    time, and at least four row groups: 60-64 rows of 2,048 inputs, 24 or 16 of 8,192):
    every row, on either side of a tile's edge, the same bits as alone or among a few, in
    every build, and float64-close; and the same rows read from a wider tensor (rows
    further apart than their inputs: the tile is packed from whatever row stride x has)."""
    rows = starts[-1] + 1
    raw, values = raw_tensor(kind, outputs, k, seed=7)
    m = pack([(kind, raw)], k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    wide = torch.randn(rows, k + 24, generator=torch.Generator().manual_seed(5))
    wide[:, 8 : 8 + k] = x
    OPS.configure("default", 2, 100)
    whole = m(x)
    assert _rel(whole, x.double() @ torch.from_numpy(values).double().T) < 2e-6
    for isa in _isas():
        OPS.configure(isa, 2, 100)
        assert torch.equal(m(x), whole), isa
        assert torch.equal(m(wide[:, 8 : 8 + k]), whole), isa
        for start in starts:
            assert torch.equal(m(x[start : start + 1]), whole[start : start + 1]), (isa, start)
        a, b = middle
        assert torch.equal(m(x[a:b]), whole[a:b]), isa


@pytest.mark.parametrize(
    ("kind", "kquant", "flat", "ratio"),
    # U4K against U4F, I8K against I8F16, I8KM against I8FM16, I8KM32 against I8FM (api.h's
    # format numbers)
    [("Q4_K", 10, 2, 4.75 / 6), ("Q6_K", 11, 6, 8.625 / 10), ("Q3_K", 11, 6, 8.625 / 10),
     ("Q2_K", 12, 7, 9.25 / 12), ("Q5_K", 13, 5, 8.75 / 10)],
)  # fmt: skip
def test_the_file_s_own_k_quant_scales_give_the_same_bits(
    kind: str, kquant: int, flat: int, ratio: float
) -> None:
    """K-quants packed with the file's two-level scales (d times an 8-bit multiplier a
    group, worked out as the kernels run) and with one float a group (the scales
    multiplied out at packing): every value the same, the bytes in the ratio of the
    formats' bits a weight, and every product the same bits, at every row count, in
    every build."""
    raw, values = raw_tensor(kind, 48 + 7, 1024, seed=11)
    packed = {
        f: Packed(OPS.pack([raw], [kind], 1024, f), f, 55, 1024, (kind,)) for f in (kquant, flat)
    }
    assert packed[kquant].nbytes == pytest.approx(packed[flat].nbytes * ratio, abs=0.5)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(2))
    for isa in _isas():
        OPS.configure(isa, 2, 100)
        for f, m in packed.items():
            rows_of = m.rows(torch.arange(55)).numpy()
            np.testing.assert_array_equal(rows_of, values, err_msg=f"{isa} {f}")
        for rows in (1, 2, 3, 4, 5, 11, 12, 17, 40):
            assert torch.equal(packed[kquant](x[:rows]), packed[flat](x[:rows])), (isa, rows)


def test_a_stack_of_mixed_types_keeps_each_ones_values() -> None:
    """Q, K and V of three types stacked as one matrix (a Q4_K_M file's mix), or a
    quantized matrix beside a dense one: one format holds every value exactly."""
    for kinds in (["Q4_K", "Q5_0", "Q6_K"], ["Q4_K", "Q6_K", "Q2_K"], ["Q4_1", "Q8_0", "F16"],
                  ["Q4_0", "BF16"]):  # fmt: skip
        parts = [raw_tensor(k, 16 * (i + 1) + 3, 256, seed=i) for i, k in enumerate(kinds)]
        m = pack([(k, raw) for k, (raw, _) in zip(kinds, parts, strict=True)], 256)
        values = np.concatenate([v for _, v in parts])
        np.testing.assert_array_equal(m.rows(torch.arange(m.out_features)).numpy(), values)
        x = torch.randn(5, 256)
        assert _rel(m(x), x.double() @ torch.from_numpy(values).double().T) < 2e-6


def test_an_unknown_format_is_refused_by_name() -> None:
    """A packed matrix said to be of a format that is not one of api.h's is refused,
    naming the format, before any kernel reads it."""
    x = torch.ones(1, 32)
    packed = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="unknown packed matrix format 14"):
        OPS.linear(x, packed, 14, 16)
    with pytest.raises(RuntimeError, match="unknown packed matrix format 0"):
        OPS.dequant(packed, 0, 16, 32, torch.tensor([0]))


def test_builds_of_other_versions_stay_the_most_recently_used(tmp_path: Any) -> None:
    """The kernels' build folder keeps other versions' builds (two installs sharing it
    do not rebuild in turn), the KEEP_BUILDS most recently used: a build found is marked
    used, and the oldest beyond them are removed."""
    import os

    from ninfer.engine import _kernels

    builds = tmp_path / "kernels"
    for i in range(_kernels.KEEP_BUILDS + 2):
        (builds / f"v{i}").mkdir(parents=True)
        (builds / f"v{i}" / _kernels.LIBRARY).write_bytes(b"")
        os.utime(builds / f"v{i}", (1000 + i, 1000 + i))  # v0 the oldest
    assert _kernels._built(tmp_path, "v0") == builds / "v0" / _kernels.LIBRARY  # used now
    _kernels._prune(builds)
    kept = sorted(d.name for d in builds.iterdir())
    assert kept == ["v0", *(f"v{i}" for i in range(3, _kernels.KEEP_BUILDS + 2))]


def test_the_build_runs_every_command_and_names_the_first_that_failed(tmp_path: Any) -> None:
    """The build's commands (compiles, as many at once as there are CPUs): every one runs
    whatever fails beside it; the answer names the first failed command in the order
    given, with its exit status and its last lines; '' when all succeed."""
    import sys

    from ninfer.engine import _kernels

    def job(name: str, code: str) -> tuple[str, list[str]]:
        return name, [sys.executable, "-c", code]

    def touch(name: str) -> tuple[str, list[str]]:
        return job(name, f"open({str(tmp_path / name)!r}, 'w').close()")

    assert _kernels._run_all([touch("a"), touch("b"), touch("c")]) == ""
    failed = _kernels._run_all([
        touch("d"),
        job("ops", "import sys; print('line 1'); print('ops.cpp:7: error: no'); sys.exit(3)"),
        job("isa_avx2", "import sys; sys.exit(1)"),
        touch("e"),
    ])  # fmt: skip
    assert failed == "compiling ops failed (exit 3):\nline 1\nops.cpp:7: error: no"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "d", "e"]


def test_two_threads_calling_at_once_each_get_their_own_answer() -> None:
    """Calls from two threads at once (the pool runs one call at a time: the other runs
    on its caller's thread) give each caller exactly its answer."""
    raw, _ = raw_tensor("Q4_1", 256, 512)
    m = pack([("Q4_1", raw)], 512)
    OPS.configure(_best_isa(), 2, 100)
    xs = [torch.randn(3, 512) for _ in range(2)]
    want = [m(x) for x in xs]
    bad: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(300):
            if not torch.equal(m(xs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a caller hung in the pool"
    assert not bad


@pytest.mark.parametrize("fn", [0, 1, 2, 3], ids=["exp", "tanh", "silu", "gelu_tanh"])
def test_the_vector_functions_are_float64_close_and_the_same_bits_everywhere(fn: int) -> None:
    """exp, tanh, SiLU and GELU (tanh form) within a few float32 ulps of float64 over
    their range (exp: to -inf and past its overflow), identical in every build."""
    x = torch.cat([
        torch.linspace(-100, 100, 20001), torch.linspace(-1e-3, 1e-3, 2001),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -87.2, 0.6249, 0.6251, -0.6251]),
    ])  # fmt: skip
    if fn == 0:  # exp also meets -inf (masked scores)
        x = torch.cat([x, torch.tensor([float("-inf")])])
    x64 = x.double()
    ref = {
        0: torch.exp(x64),
        1: torch.tanh(x64),
        2: torch.nn.functional.silu(x64),
        3: torch.nn.functional.gelu(x64, approximate="tanh"),
    }[fn]
    OPS.configure("default", 1, 100)
    out = OPS.elementwise(x, fn)
    for isa in _isas():
        OPS.configure(isa, 1, 100)
        assert torch.equal(OPS.elementwise(x, fn), out), isa
    finite = torch.isfinite(ref) & (ref.abs() < 3e38)
    err = (out.double()[finite] - ref[finite]).abs()
    scale = ref[finite].abs().clamp_min(1e-37)
    # relative (8 ulp: GELU's cubic rounds on the way) where the value is not tiny;
    # absolute near 0
    assert float((err / scale)[ref[finite].abs() > 1e-3].max()) < 1e-6
    assert float(err.max()) < 1e-6 * max(1.0, float(ref[finite].abs().max()))
    if fn == 0:
        assert out[x == float("-inf")].eq(0).all()
        assert torch.isinf(OPS.elementwise(torch.tensor([89.0]), 0)).all()


def test_rmsnorm_is_float64_close_and_the_same_bits_everywhere() -> None:
    x = torch.randn(9, 640) * 30
    w = torch.rand(640) + 0.5
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    OPS.configure("default", 1, 100)
    out = OPS.rmsnorm(x, w, 1e-6)
    assert _rel(out, ref) < 1e-6
    for isa in _isas():
        OPS.configure(isa, 1, 100)
        assert torch.equal(OPS.rmsnorm(x, w, 1e-6), out)


def _pool(layers: int, pages: int, kv_heads: int, head_dim: int, store: str) -> KVPages:
    from ninfer.engine._gguf import ModelArgs

    args = ModelArgs(
        architecture="llama", n_layers=layers, dim=64, n_heads=kv_heads, n_kv_heads=kv_heads,
        head_dim=head_dim, ffn_dim=64, vocab_size=8, context_length=4096, rope_base=1e4,
        norm_eps=1e-5,
    )  # fmt: skip
    kv = KVPages.allocate(
        args, n_pages=pages, page_size=16, dtype=torch.float32, device="cpu",
        kv_dtype=store, keys_transposed=True,
    )  # fmt: skip
    kv.zero_pages(list(range(kv.scratch_page + 1)))
    return kv


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, window: int, scale: float,
                         softcap: float) -> torch.Tensor:  # fmt: skip
    """One row's queries q (N, H, D) at `positions` over its keys and values (P, G, D)."""
    H, G = q.shape[1], k.shape[1]
    kh = k.double().repeat_interleave(H // G, 1).transpose(0, 1)  # (H, P, D)
    vh = v.double().repeat_interleave(H // G, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kh.transpose(1, 2) * scale  # (H, N, P)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    key = torch.arange(k.shape[0])
    behind = positions.view(-1, 1) - key.view(1, -1)
    visible = (behind >= 0) & ((behind < window) if window > 0 else True)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return (probs @ vh).transpose(0, 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "softcap", "store"),
    [(9, 3, 64, 0, 0.0, "float32"), (4, 1, 256, 0, 0.0, "float32"),
     (4, 2, 32, 40, 0.0, "float32"), (8, 8, 16, 0, 30.0, "float32"),
     (6, 2, 48, 0, 0.0, "int8"), (12, 1, 32, 21, 0.0, "int8"),
     (80, 1, 16, 0, 0.0, "float32"), (9, 3, 64, 0, 0.0, "float16"),
     (12, 1, 32, 21, 30.0, "float16"), (4, 1, 256, 0, 0.0, "float16")],
)  # fmt: skip
def test_attention_over_the_page_pool(heads: int, kv_heads: int, head_dim: int, window: int,
                                      softcap: float, store: str) -> None:  # fmt: skip
    """A row's queries over its keys and values on scattered pages (float32, halves, or
    int8 with scales): within 1e-5 of float64 (of the values the pool holds), and each
    query's numbers the same alone, among the others, in blocks cut anywhere (a prompt's
    chunks), beside another row's queries (a decode batch, where a kv head's query heads
    may be cut in parts), in any build and at any thread count. The shapes give blocks of
    16 queries, of 5 (12 heads a kv head) and of one query with more heads than a block
    aims at (80)."""
    torch.manual_seed(0)
    n_keys = 150
    int8 = store == "int8"
    kv = _pool(2, 24, kv_heads, head_dim, store)
    pages = torch.tensor([[3, 17, 1, 9, 22, 4, 11, 14, 6, 20]])
    positions = torch.arange(n_keys)
    k = torch.randn(n_keys, kv_heads, head_dim)
    v = torch.randn(n_keys, kv_heads, head_dim)
    page, slot = pages[0, positions // 16], positions % 16
    layer = 1
    if int8:  # stored as int8 with a scale a position and head; the reference sees those
        for t, store, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            s = t.abs().amax(-1, keepdim=True) / 127
            q8 = torch.round(t / s).clamp(-127, 127)
            t.copy_(q8 * s)
            assert scales is not None
            scales[layer, page, :, slot] = s
            if store is kv.k:
                store[layer, page, :, :, slot] = q8.to(torch.int8)
            else:
                store[layer, page, :, slot] = q8.to(torch.int8)
    else:  # halves: the reference sees the values they hold
        if store == "float16":
            k, v = k.half().float(), v.half().float()
        kv.k[layer, page, :, :, slot] = k.to(kv.k.dtype)
        kv.v[layer, page, :, slot] = v.to(kv.v.dtype)
    # a second row holding the same keys and values on other pages
    pages = torch.cat([pages, torch.tensor([[2, 5, 7, 8, 10, 12, 13, 15, 16, 18]])])
    for store in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        if store is not None:
            store[layer, pages[1]] = store[layer, pages[0]]
    q = torch.randn(n_keys, heads, head_dim)
    scale = head_dim**-0.5
    ref = _reference_attention(q, k, v, positions, window, scale, softcap)
    row = torch.zeros(n_keys, dtype=torch.long)

    def run(idx: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        which = row[idx] if rows is None else rows
        return _native.attention(q[idx], kv, layer, pages, which, positions[idx],
                                 window=window, scale=scale, softcap=softcap)  # fmt: skip

    OPS.configure("default", 1, 100)
    every = torch.arange(n_keys)
    out = run(every)
    assert _rel(out.reshape(-1, head_dim), ref.reshape(-1, head_dim)) < 1e-5
    for isa in _isas():
        for threads in (1, 2):
            OPS.configure(isa, threads, 100)
            assert torch.equal(run(every), out), (isa, threads)
            some = torch.tensor([149, 3, 77, 16, 15, 0])
            assert torch.equal(run(some), out[some]), (isa, threads)
            # (a 16-query chunk's tasks are too few for the threads: its blocks are cut
            # smaller)
            cuts = (0, 16, 37, 38, 101, n_keys)
            chunks = [run(every[a:b]) for a, b in itertools.pairwise(cuts)]
            assert torch.equal(torch.cat(chunks), out), (isa, threads)
            batch = torch.tensor([148, 148, 60, 61, 0, 90])
            rows = torch.tensor([0, 1, 1, 0, 1, 1])
            assert torch.equal(run(batch, rows), out[batch]), (isa, threads)
            # a decode step: one query a row, a kv head's query heads cut in parts where
            # the threads outnumber the kv heads
            for step, step_rows in (([149], [0]), ([149, 77, 3], [0, 1, 0])):
                idx = torch.tensor(step)
                assert torch.equal(run(idx, torch.tensor(step_rows)), out[idx]), (isa, threads)


def test_the_engine_runs_on_the_native_kernels_by_default(tiny_gguf: Any) -> None:
    """The server's start (`start_kernels` with the default settings) loads the library
    and configures the build torch dispatches to; the model loads onto it."""
    from ninfer.engine import EngineConfig
    from ninfer.engine._kernels import torch_isa
    from ninfer.engine._runtime import start_kernels

    choice = start_kernels(EngineConfig(threads=2), lambda _m: None)
    assert choice.native
    assert (choice.isa, choice.threads) == (torch_isa(), 2)
    assert choice.describe() == f"native {torch_isa()}, 2 threads"
    torch_only = start_kernels(EngineConfig(kernels="torch"), lambda _m: None)
    assert (torch_only.native, torch_only.reason) == (False, "--kernels torch")
    bf16 = start_kernels(EngineConfig(dtype="bfloat16"), lambda _m: None)
    assert not bf16.native
    assert "float32" in bf16.reason


def test_without_a_compiler_the_server_says_so_and_runs_torchs_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A machine with no C++ compiler and no built library: --kernels auto goes on with
    torch's kernels and the console says why; --kernels native refuses to start."""
    from ninfer.engine import EngineConfig, _kernels
    from ninfer.engine._errors import ConfigError
    from ninfer.engine._runtime import start_kernels

    monkeypatch.setattr(_kernels, "_compiler", lambda: None)
    said: list[str] = []
    choice = start_kernels(EngineConfig(), said.append)
    assert not choice.native
    assert "no C++ compiler" in choice.reason
    assert said == [f"kernels: torch's ({choice.reason})"]
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        start_kernels(EngineConfig(kernels="native"), said.append)


def _greedy(running: Any) -> list[list[int]]:
    """An engine's greedy tokens for three prompts."""
    from ninfer.engine import GenerationRequest

    handles = [
        running.engine.submit(GenerationRequest(f"g{i}", tuple(range(3 + i, 20 + 3 * i)), 8))
        for i in range(3)
    ]
    running.sink.wait_done(*handles)
    return [running.sink.tokens[h.id] for h in handles]


@pytest.mark.parametrize("faster", ["native", "torch"])
def test_auto_on_the_plain_build_serves_what_a_measured_step_found_faster(
    faster: str, tiny_gguf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the native kernels have only their plain build for the CPU (forced here, as
    on a CPU without AVX2 or under ATEN_CPU_CAPABILITY=default), --kernels auto times a
    decode step on them and on torch's kernels and serves the faster (the timings forced
    each way), says which and why on the console, and answers as an engine held to
    those kernels; --kernels native measures nothing."""
    from conftest import start_engine, stop_engine

    from ninfer.engine import EngineConfig, _runtime

    monkeypatch.setattr(_runtime, "torch_isa", lambda: "default")
    slow, quick = 0.040, 0.010
    monkeypatch.setattr(
        _runtime,
        "step_seconds",
        lambda model, _device: (
            quick if (model.native is not None) == (faster == "native") else slow
        ),
    )
    said: list[str] = []
    running = start_engine(tiny_gguf, EngineConfig(max_batch=4, threads=2), said.append)
    try:
        kernels, tokens = running.engine.served().kernels, _greedy(running)
    finally:
        stop_engine(running)
    (line,) = [m for m in said if m.startswith("kernels:")]
    if faster == "native":
        assert kernels == "native default, 2 threads"
        assert (
            line
            == "kernels: the native plain build (a decode step 10.0 ms on them, 40.0 ms on torch's)"
        )
        held = EngineConfig(max_batch=4, threads=2, kernels="native")
    else:
        assert kernels.startswith("torch (the native kernels' plain build is slower here")
        assert line == (
            "kernels: torch's (the native kernels' plain build is slower here: "
            "a decode step 40.0 ms on them, 10.0 ms on torch's)"
        )
        held = EngineConfig(max_batch=4, threads=2, kernels="torch")
    said.clear()
    running = start_engine(tiny_gguf, held, said.append)
    try:
        assert _greedy(running) == tokens
    finally:
        stop_engine(running)
    assert not any("decode step" in m for m in said)


def test_auto_on_the_plain_build_times_a_real_step_each_way(
    tiny_gguf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unforced, the measurement runs on the model itself: the console gives both
    steps' times, and the kernels that serve are the faster of the two it gives."""
    import re

    from conftest import start_engine, stop_engine

    from ninfer.engine import EngineConfig, _runtime

    monkeypatch.setattr(_runtime, "torch_isa", lambda: "default")
    said: list[str] = []
    running = start_engine(tiny_gguf, EngineConfig(max_batch=4, threads=2), said.append)
    try:
        kernels = running.engine.served().kernels
    finally:
        stop_engine(running)
    (line,) = [m for m in said if "a decode step" in m]
    found = re.search(r"a decode step ([\d.]+) ms on them, ([\d.]+) ms on torch's", line)
    assert found is not None, line
    native_ms, torch_ms = float(found[1]), float(found[2])
    if torch_ms == native_ms:  # equal to the tenth of a millisecond printed: either is faster
        assert kernels.startswith(("torch", "native default")), kernels
    else:
        assert kernels.startswith("torch" if torch_ms < native_ms else "native default")


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    top_p=st.floats(0.01, 0.999),
    sharpness=st.floats(0.1, 8.0),
    ties=st.booleans(),
)
def test_native_top_p_keeps_what_the_torch_definition_keeps(
    seed: int, top_p: float, sharpness: float, ties: bool
) -> None:
    """The native top-p (one pass, a sort of the candidates) keeps exactly the ids of
    `top_p_kept` (tests/test_sampling.py holds that to a sort of the whole row), ties
    included."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * sharpness
    if ties:
        logits = torch.round(logits)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(native_top_p_kept(probs, top_p), top_p_kept(probs, top_p))


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    k=st.integers(1, 300),
    ties=st.booleans(),
    banned=st.booleans(),
)
def test_native_top_k_keeps_what_torchs_keeps(seed: int, k: int, ties: bool, banned: bool) -> None:
    """The native top-k (a heap over one pass, runs of 64 below the bound passed over)
    keeps exactly the ids of `top_k_ids` (torch.topk and the ties with the k-th, held
    to the whole row's chain in tests/test_sampling.py): rows with many ties, and with
    banned (-inf) tokens, up to all but a few."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:
        logits = torch.round(logits)
    if banned:
        logits[torch.arange(5000) % 7 != 0] = float("-inf")
    assert torch.equal(native_top_k_ids(logits, k), top_k_ids(logits, k))


def _samplers(cases: list[tuple[int, float, float, float, int]], vocab: int) -> list[RowSampler]:
    return [
        RowSampler.create(
            SamplingParams(temperature=t, top_k=k, min_p=mp, top_p=tp, seed=seed),
            vocab,
            native_sample=True,
        )
        for k, t, mp, tp, seed in cases
    ]


def _first_uniform(seed: int) -> float:
    """The draw a fresh sampler seeded `seed` takes first (`native_sample` takes one a row)."""
    gen = torch.Generator().manual_seed(seed)
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    k=st.sampled_from([1, 2, 5, 40, 300]),
    temperature=st.sampled_from([1e-6, 0.3, 0.8, 1.0, 2.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    top_p=st.sampled_from([0.1, 0.5, 0.95, 1.0]),
    ties=st.booleans(),
    banned=st.booleans(),
)
def test_the_batched_sampler_picks_its_float64_definitions_token(
    seed: int, k: int, temperature: float, min_p: float, top_p: float, ties: bool, banned: bool
) -> None:
    """The step's one native sampling call picks, for each row, the token its float64
    definition (`reference_pick`: top-k, temperature, min-p, top-p, the draw) picks from
    the same generator draw, but where a boundary lies within 1e-5 of it (the float32
    exponential's reach); the same token in every build; and a row's token is the same
    alone as among other rows and other parameters."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5000, generator=gen) * 4
    if ties:
        logits = torch.round(logits)
    if banned:
        logits[:, torch.arange(5000) % 3 != 0] = float("-inf")
    cases = [(k, temperature, min_p, top_p, seed + r) for r in range(3)]
    cases += [(40, 0.8, 0.05, 0.95, seed + 3)]  # a fourth row: row 0 again, other settings
    rows = [0, 1, 2, 0]
    OPS.configure("default", 1, 100)
    picks = native_sample(logits, rows, _samplers(cases, 5000))
    for isa in _isas():
        for threads in (1, 3):
            OPS.configure(isa, threads, 100)
            assert native_sample(logits, rows, _samplers(cases, 5000)) == picks, (isa, threads)
            alone = [
                native_sample(logits, [r], _samplers([c], 5000))[0]
                for r, c in zip(rows, cases, strict=True)
            ]
            assert alone == picks, (isa, threads)
    for r, (kk, t, mp, tp, s), token in zip(rows, cases, picks, strict=True):
        assert near_reference(token, logits[r], kk, t, mp, tp, _first_uniform(s), 1e-5)
        assert logits[r, token] > float("-inf") or bool((logits[r] == float("-inf")).all())


def test_the_batched_sampler_draws_as_pick_does_on_a_known_distribution() -> None:
    """On a row whose kept tokens are known exactly, the draw lands where the cumulative
    mass says: three tokens at e^0, e^-ln2, e^-ln4 (masses 4:2:1 after temperature 1) and
    the rest far below min-p; a uniform draw in each one's share of the running mass (in
    id order) gives it, and top-p 0.5 keeps the likeliest alone."""
    V = 1000
    row = torch.full((1, V), -100.0)
    row[0, 7], row[0, 3], row[0, 500] = 0.0, -float(np.log(2)), -float(np.log(4))
    # in id order the running mass is 2/7 (token 3), 6/7 (7), 1 (500): seeds whose first
    # uniform draw falls in each part
    wanted = {3: (0.0, 2 / 7), 7: (2 / 7, 6 / 7), 500: (6 / 7, 1.0)}
    for token, (lo, hi) in wanted.items():
        seed = next(s for s in range(10_000) if lo + 1e-3 < _first_uniform(s) < hi - 1e-3)
        sampler = _samplers([(40, 1.0, 0.01, 1.0, seed)], V)
        assert native_sample(row, [0], sampler) == [token]
        only = _samplers([(40, 1.0, 0.01, 0.5, seed)], V)
        assert native_sample(row, [0], only) == [7]
