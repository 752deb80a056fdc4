"""The torch forward: the paged KV cache reproduces a full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.engine._loader import load_model
from ninfer.engine._model import KVPages


@pytest.mark.parametrize(("weights", "tol"), [("dense", 1e-4), ("int4", 5e-2)])
def test_cached_decode_equals_full_recompute(tiny_gguf: Path, weights: str, tol: float) -> None:
    """Logits of position t from prefill+decode with the cache match a fresh full pass
    (in int4 mode the matmuls take bfloat16 inputs: prefill and decode round apart)."""
    m = load_model(
        str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=128, weights=weights
    )
    model = m.transformer
    tokens = torch.randint(
        3, m.identity.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        kv = KVPages.allocate(model.args, n_pages=8, page_size=8, dtype=torch.float32, device="cpu")
        pages = [3, 1, 7, 2, 5, 4]  # deliberately out of order
        kv.zero_pages(pages)
        table = torch.tensor([pages])
        full = model.forward(tokens, torch.arange(40).view(1, -1), table, kv, last_only=False)
        kv2 = KVPages.allocate(
            model.args, n_pages=8, page_size=8, dtype=torch.float32, device="cpu"
        )
        kv2.zero_pages(pages)
        step = [
            model.forward(tokens[:, :25], torch.arange(25).view(1, -1), table, kv2, last_only=True)
        ]
        for t in range(25, 40):
            step.append(
                model.forward(tokens[:, t : t + 1], torch.tensor([[t]]), table, kv2, last_only=True)
            )
    incremental = torch.cat(step)  # (16, V): positions 24..39
    torch.testing.assert_close(incremental, full[0, 24:40], rtol=tol, atol=tol)


def test_padding_rows_do_not_change_results(tiny_gguf: Path) -> None:
    """A row's logits are the same whether its page table is padded wider or not."""
    m = load_model(str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=128)
    model = m.transformer
    with torch.inference_mode():
        kv = KVPages.allocate(model.args, n_pages=8, page_size=8, dtype=torch.float32, device="cpu")
        kv.zero_pages([1, 2])
        tokens = torch.arange(3, 13).view(1, -1)
        model.forward(
            tokens, torch.arange(10).view(1, -1), torch.tensor([[1, 2]]), kv, last_only=True
        )
        narrow = model.forward(
            torch.tensor([[5]]), torch.tensor([[10]]), torch.tensor([[1, 2]]), kv, last_only=True
        )
        wide = model.forward(
            torch.tensor([[5]]),
            torch.tensor([[10]]),
            torch.tensor([[1, 2, 0, 0]]),
            kv,
            last_only=True,
        )
    torch.testing.assert_close(narrow, wide, rtol=1e-5, atol=1e-5)


def test_attention_rows_do_not_depend_on_the_batch() -> None:
    """Each row's attention is the same alone, in any batch, and with padded keys."""
    from ninfer.engine._model import _attention

    g = torch.Generator().manual_seed(3)
    B, H, G, K, D = 6, 9, 3, 40, 64
    q = torch.randn((B, H, 1, D), generator=g)
    k = torch.randn((B, G, K, D), generator=g)
    v = torch.randn((B, G, K, D), generator=g)
    lens = torch.tensor([1, 7, 16, 23, 40, 33])
    mask = torch.arange(K).view(1, 1, 1, K) < lens.view(B, 1, 1, 1)
    together = _attention(q, k, v, mask)
    for i in range(B):
        alone = _attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask[i : i + 1])
        assert torch.equal(alone, together[i : i + 1])
    pad = torch.zeros((B, G, 24, D))
    padded = _attention(
        q, torch.cat([k, pad], 2), torch.cat([v, pad], 2),
        torch.cat([mask, torch.zeros((B, 1, 1, 24), dtype=torch.bool)], 3),
    )  # fmt: skip
    assert torch.equal(padded, together)


def test_invariant_batch_sizes_always_include_the_largest() -> None:
    from ninfer.engine._invariance import invariant_batch_sizes
    from ninfer.engine._model import Dense

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    sizes = invariant_batch_sizes([Dense(w)], max_rows=8)
    assert sizes is not None
    assert sizes[-1] == 8
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize(
    ("architecture", "rope_freqs", "head_dim"),
    [("llama", False, None), ("llama", True, None), ("qwen2", False, None),
     ("qwen3", False, None), ("qwen3", False, 32), ("gemma3", False, None)],
    ids=["llama", "llama3-rope-scaling", "qwen2", "qwen3", "qwen3-wide-heads", "gemma3"],
)  # fmt: skip
def test_logits_equal_an_independent_float64_forward(
    tmp_path: Path, architecture: str, rope_freqs: bool, head_dim: int | None
) -> None:
    """Each architecture of the family against tests/reference_forward.py (numpy, float64,
    gguf's dequantizers): the engine in float32 with dense weights agrees to float32
    rounding at every position. Gemma 3 with six layers (five sliding-window layers of 8
    keys, one global) over 24 positions: the window and both rope bases are exercised."""
    from reference_forward import reference_logits
    from tinymodel import write_tiny_gguf

    path = write_tiny_gguf(
        tmp_path / f"{architecture}.gguf",
        architecture=architecture,
        rope_freqs=rope_freqs,
        head_dim=head_dim,  # 32 x 4 heads = 128 > dim 64, as Qwen 3 0.6B's 128 x 16 > 1024
        n_layers=6 if architecture == "gemma3" else 2,
    )
    m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=64, weights="dense")
    assert m.identity.architecture == architecture
    tokens = torch.randint(
        3, m.identity.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1)
    )
    model = m.transformer
    with torch.inference_mode():
        kv = KVPages.allocate(model.args, n_pages=4, page_size=8, dtype=torch.float32, device="cpu")
        kv.zero_pages([1, 2, 3])
        ours = model.forward(
            tokens, torch.arange(24).view(1, -1), torch.tensor([[1, 2, 3]]), kv, last_only=False
        )[0]
    ref = torch.from_numpy(reference_logits(path, tokens[0].tolist()))
    assert ref.abs().max() > 1.0  # logits that vary: a meaningful comparison
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_gives_float32_logits_in_int4_mode(tmp_path: Path, tied: bool) -> None:
    """The output head's logits are the float32 product of the final hidden states and
    the file's head values (to float32 rounding), in the default int4 mode too. The head
    used to be a bfloat16 matmul whose output was rounded to 8 significant bits (steps of
    0.125 near 25): SmolLM2's two best first tokens for the README's question are 0.08
    apart, tied after rounding on AVX2 CPUs, and argmax answered in French (issue 27).
    An untied Q4 head is not the int4 kernel either: it rounds its output the same way."""
    import gguf
    import numpy as np
    from tinymodel import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", tied=tied, packed_layers=True)
    m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=64)
    reader = gguf.GGUFReader(str(path))
    name = "token_embd.weight" if tied else "output.weight"
    (t,) = [t for t in reader.tensors if t.name == name]
    table = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1, 64)
    x = torch.randn((5, 64), generator=torch.Generator().manual_seed(3)) * 4
    with torch.inference_mode():
        ours = m.transformer.lm_head(x)
    ref = torch.from_numpy(x.double().numpy() @ table.T)
    assert ours.dtype == torch.float32
    rel = ((ours.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-6, rel  # bfloat16 output: ~1e-3


def test_narrowing_keeps_the_layers_dense_matrices_in_bfloat16(tiny_gguf: Path) -> None:
    """What the engine does when float32 matmuls would pad most decode steps: every
    float32 matrix of the layers becomes its bfloat16 rounding (the int4 ones and the
    head untouched), and the maps measured beforehand are those matrices."""
    from ninfer.engine._model import Dense, Int4

    m = load_model(str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=64)
    model = m.transformer
    assert model.narrowable
    before = [(layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down) for layer in model.layers]
    preview = model.row_maps(narrowed=True)[:4]
    head = model.lm_head
    model.narrow_dense()
    assert not model.narrowable
    assert model.lm_head is head
    for layer, old in zip(model.layers, before, strict=True):
        new = (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
        for a, b in zip(old, new, strict=True):
            if isinstance(a, Int4):
                assert b is a
            else:
                assert isinstance(a, Dense)
                assert isinstance(b, Dense)
                assert b.weight.dtype == torch.bfloat16
                assert torch.equal(b.weight, a.weight.to(torch.bfloat16))
    first = model.layers[0]
    for p, b in zip(preview, (first.wqkv, first.wo, first.w_gate_up, first.w_down), strict=True):
        assert type(p) is type(b)
        if isinstance(p, Dense) and isinstance(b, Dense):
            assert torch.equal(p.weight, b.weight)
    tokens = torch.tensor([[5, 9, 11]])
    with torch.inference_mode():
        kv = KVPages.allocate(model.args, n_pages=1, page_size=8, dtype=torch.float32, device="cpu")
        kv.zero_pages([1])
        logits = model.forward(tokens, torch.arange(3).view(1, -1), torch.tensor([[1]]), kv,
                               last_only=True)  # fmt: skip
    assert torch.isfinite(logits).all()


def test_groups_in_one_pass_equal_each_group_alone(tmp_path: Path) -> None:
    """`hidden_many` (prompts prefilled together, a decode batch beside them) gives each
    group the hidden states and the keys and values it gets in a pass of its own, bit
    for bit, on a model whose matrices all run through the int4 kernel; a chunk may
    start inside a page."""
    from tinymodel import write_tiny_gguf

    from ninfer.engine._invariance import rows_independent_of_count

    path = write_tiny_gguf(tmp_path / "packed.gguf", packed_layers=True)
    model = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=256).transformer
    assert rows_independent_of_count(model.layer_maps(), max_rows=64)
    gen = torch.Generator().manual_seed(5)

    def groups() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        gen.manual_seed(5)
        return [
            # a prompt's chunk from position 5 (inside its first page) to 17
            (torch.randint(3, 200, (1, 12), generator=gen), torch.arange(5, 17).view(1, -1),
             torch.tensor([[1, 2, 3]])),
            # a decode batch of two rows
            (torch.randint(3, 200, (2, 1), generator=gen), torch.tensor([[9], [3]]),
             torch.tensor([[4, 5], [6, 0]])),
            # a whole short prompt
            (torch.randint(3, 200, (1, 4), generator=gen), torch.arange(4).view(1, -1),
             torch.tensor([[7]])),
        ]  # fmt: skip

    with torch.inference_mode():
        pools = []
        for _ in range(2):
            kv = KVPages.allocate(model.args, n_pages=8, page_size=8, dtype=torch.float32,
                                  device="cpu")  # fmt: skip
            # every page, the scratch one too: memory left uninitialised may hold NaNs,
            # which no copy makes equal to themselves
            kv.zero_pages(list(range(1, kv.scratch_page + 1)))
            kv.k[:, 1:8].normal_(generator=gen)  # earlier keys and values, the same in both
            kv.v[:, 1:8].normal_(generator=gen)
            pools.append(kv)
        pools[1].k.copy_(pools[0].k)
        pools[1].v.copy_(pools[0].v)
        together = model.hidden_many(groups(), pools[0])
        alone = [model.hidden(*g, pools[1]) for g in groups()]
    assert all(torch.equal(t, a) for t, a in zip(together, alone, strict=True))
    # the pages requests own, bit for bit (the scratch page is where padding rows write)
    real = slice(0, pools[0].scratch_page)
    assert torch.equal(pools[0].k[:, real], pools[1].k[:, real])
    assert torch.equal(pools[0].v[:, real], pools[1].v[:, real])
