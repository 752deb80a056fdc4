"""Loading GGUF files: identity, tensor types, and clear errors for what cannot run."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tinymodel import write_tiny_gguf

from ninfer._errors import ArtifactError
from ninfer.engine._gguf import dequantize, file_sha256, open_gguf
from ninfer.engine._loader import load_model


def test_identity_of_tiny_model(tiny_gguf: Path) -> None:
    """The identity comes from the file: id from metadata, arch, sha256, context, vocab."""
    m = load_model(str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=64)
    ident = m.identity
    assert ident.model_id == "tiny-test-llama"
    assert ident.architecture == "llama"
    assert ident.sha256 == file_sha256(tiny_gguf)
    assert ident.context_length == 512
    assert ident.vocab_size == m.tokenizer.vocab_size == m.transformer.embedding.shape[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"], ids=lambda q: q)
def test_dequantize_matches_gguf_reference(tmp_path: Path, qtype: str) -> None:
    """Our torch dequantizer agrees with gguf's numpy reference for every supported type."""
    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    data = rng.standard_normal((8, 64)).astype(np.float32)
    path = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if qtype == "F32":
        w.add_tensor("x", data)
    elif qtype == "F16":
        w.add_tensor("x", data.astype(np.float16))
    else:
        w.add_tensor("x", gguf.quants.quantize(data, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    ours = dequantize(tensor, torch.float32)
    ref = gguf.quants.dequantize(tensor.data, t).reshape(8, 64)
    assert ours.shape == (8, 64)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=1e-6)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(ArtifactError, match="unsupported model architecture 'mamba'"):
        open_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", embed_type=gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ArtifactError, match=r"unsupported tensor type Q5_0 \(tensor token_embd"):
        open_gguf(path)


def test_truncated_file_is_a_clear_error(tmp_path: Path, tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated or corrupted"):
        open_gguf(path)


def test_garbage_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ArtifactError, match="not a readable GGUF file"):
        open_gguf(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="model file not found"):
        open_gguf(tmp_path / "absent.gguf")


def test_untied_output_head_is_used(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=64)
    assert m.transformer.lm_head is not m.transformer.embedding
