"""The torch forward: the paged KV cache reproduces a full recompute."""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer._loader import load_model
from ninfer._model import KVPages


def test_cached_decode_equals_full_recompute(tiny_gguf: Path) -> None:
    """Logits of position t from prefill+decode with the cache match a fresh full pass."""
    m = load_model(str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=128)
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
    torch.testing.assert_close(incremental, full[0, 24:40], rtol=1e-4, atol=1e-4)


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
