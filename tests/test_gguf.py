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


@pytest.mark.parametrize(
    "qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"], ids=lambda q: q
)
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
    np.testing.assert_array_equal(ours.numpy(), ref)  # bit for bit


# K-quant block sizes and where each block's float16 scales sit (llama.cpp's structs).
K_QUANTS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
            "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # fmt: skip


def write_k_quant(path: Path, qtype: str, rows: int, cols: int, seed: int = 0) -> Path:
    """A GGUF holding one K-quant tensor of random blocks (any bit pattern is a valid
    block once its float16 scales are finite: those are drawn as small normals)."""
    size, f16_at = K_QUANTS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in f16_at:
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    w = gguf.GGUFWriter(str(path), "llama")
    t = gguf.GGMLQuantizationType[qtype]
    w.add_tensor("x", blocks.reshape(rows, -1), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
def test_k_quants_equal_the_gguf_reference_bit_for_bit(tmp_path: Path, qtype: str) -> None:
    path = write_k_quant(tmp_path / "k.gguf", qtype, rows=6, cols=512)
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    ours = dequantize(tensor, torch.float32)
    ref = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[qtype]).reshape(6, 512)
    assert ours.shape == (6, 512)
    np.testing.assert_array_equal(ours.numpy(), ref)


def test_q4_k_runs_packed_as_the_same_values(tmp_path: Path) -> None:
    """Q4_K's 32-element sub-blocks map onto the int4 kernel's groups exactly: the packed
    form (q - 8) * scale + zero gives the dequantized values (to float32 rounding)."""
    from ninfer.engine._gguf import GGUFFile

    path = write_k_quant(tmp_path / "k.gguf", "Q4_K", rows=4, cols=512, seed=3)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    file = GGUFFile(path=str(path), metadata={}, tensors=tensors, args=None)  # type: ignore[arg-type]
    blocks = file.int4_blocks("x")
    assert blocks is not None
    q, scale, zero = blocks
    values = (q.to(torch.float32) - 8) * scale.repeat_interleave(
        32, dim=1
    ) + zero.repeat_interleave(32, dim=1)
    torch.testing.assert_close(values, file.tensor("x", torch.float32), rtol=0, atol=1e-6)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", architecture="mamba")
    with pytest.raises(ArtifactError, match="unsupported model architecture 'mamba'"):
        open_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", embed_type=gguf.GGMLQuantizationType.MXFP4)
    with pytest.raises(ArtifactError, match=r"unsupported tensor type MXFP4 \(tensor token_embd"):
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


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # Llama 3 (tiktoken's cl100k split): numbers in runs of up to three digits.
        ("llama-bpe", "Hello world's 12345 numbers!!\n\n  x",
         ["Hello", " world", "'s", " ", "123", "45", " numbers", "!!\n\n", " ", " x"]),
        # Qwen 2: numbers digit by digit, the rest alike.
        ("qwen2", "Hello world's 12345!!\n\n  x",
         ["Hello", " world", "'s", " ", "1", "2", "3", "4", "5", "!!\n\n", " ", " x"]),
        ("qwen2", "I'LL go\tnow", ["I", "'LL", " go", "\tnow"]),  # a tab leads a word too
    ],
)  # fmt: skip
def test_the_family_pre_tokenizers_split_as_published(
    pre: str, text: str, pieces: list[str]
) -> None:
    """The split before byte-level BPE for Llama 3 and Qwen 2 files, against the pieces
    their published regex gives (shown here as text; the tokenizer sees them as bytes)."""
    from ninfer.engine._tokenizer import _pre_tokenizer

    byte_level = {ch: b for b, ch in enumerate(_byte_alphabet())}
    got = [bytes(byte_level[c] for c in piece).decode()
           for piece, _ in _pre_tokenizer(pre).pre_tokenize_str(text)]  # fmt: skip
    assert got == pieces


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order."""
    from tinymodel import _bytes_to_unicode

    return _bytes_to_unicode()


def _same_as_gguf_reader(path: Path) -> None:
    from ninfer.engine._gguf_reader import read_gguf

    metadata, tensors = read_gguf(str(path))
    reader = gguf.GGUFReader(str(path))
    assert metadata == {k: f.contents() for k, f in reader.fields.items()
                        if not k.startswith("GGUF.")}  # fmt: skip
    assert len(tensors) == len(reader.tensors)
    for ours, ref in zip(tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.n_elements) == (
            ref.name, ref.tensor_type, ref.n_elements)  # fmt: skip
        assert ours.shape.tolist() == ref.shape.tolist()
        assert (ours.data.shape, ours.data.dtype) == (ref.data.shape, ref.data.dtype)
        np.testing.assert_array_equal(ours.data.view(np.uint8), np.asarray(ref.data).view(np.uint8))


def test_the_container_reader_agrees_with_gguf_reader(tmp_path: Path) -> None:
    """ninfer's one-pass reader gives what the `gguf` package's reader gives: every
    metadata value, every tensor's name, type, shape and bytes (tiny files of each
    architecture, tied and untied, with every tensor type the writer makes)."""
    for arch in ("llama", "qwen2", "qwen3"):
        _same_as_gguf_reader(write_tiny_gguf(tmp_path / f"{arch}.gguf", architecture=arch))
    _same_as_gguf_reader(write_tiny_gguf(tmp_path / "untied.gguf", tied=False, rope_freqs=True))
    _same_as_gguf_reader(write_k_quant(tmp_path / "k.gguf", "Q6_K", rows=2, cols=256))


def test_a_file_that_is_not_gguf_is_refused_by_the_reader(tmp_path: Path) -> None:
    from ninfer.engine._gguf_reader import read_gguf

    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(str(path))
