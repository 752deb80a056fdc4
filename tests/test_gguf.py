"""Loading GGUF files: identity, tensor types, and clear errors for what cannot run."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import counting_tokenizer
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tinymodel import write_tiny_gguf

from ninfer._errors import ArtifactError
from ninfer.engine import _gguf
from ninfer.engine._gguf import dequantize, file_sha256, open_gguf
from ninfer.engine._loader import load_model
from ninfer.engine._tokenizer import TextTokenizer, tokenizer_from_metadata


def test_identity_of_tiny_model(tiny_gguf: Path) -> None:
    """The identity comes from the file: id from metadata, arch, sha256, context, vocab."""
    m = load_model(str(tiny_gguf), dtype=torch.float32, device="cpu", max_positions=64)
    ident = m.identity
    assert ident.model_id == "tiny-test-llama"
    assert ident.architecture == "llama"
    assert ident.sha256 == file_sha256(tiny_gguf)
    assert ident.context_length == 512
    assert ident.vocab_size == m.tokenizer.vocab_size == m.transformer.embedding.shape[0]


def test_a_files_digest_is_remembered_under_its_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a memo directory the digest is the file's; a file changed in the last
    RACY_S seconds is not remembered; an older one is, and is then read back rather
    than hashed (a planted digest comes back); the same path replaced (another inode)
    or its modification time changed is hashed again; a memo that is not a digest is
    not believed."""
    f, memo = tmp_path / "m.gguf", tmp_path / "digests"
    f.write_bytes(b"model bytes " * 1000)
    true = hashlib.sha256(f.read_bytes()).hexdigest()
    assert file_sha256(f) == file_sha256(f, memo) == true
    assert list(memo.glob("*.sha256")) == []  # just written: racy
    monkeypatch.setattr(_gguf, "RACY_S", -1.0)
    assert file_sha256(f, memo) == true
    (kept,) = memo.glob("*.sha256")
    kept.write_text("ab" * 32 + "\n")
    assert file_sha256(f, memo) == "ab" * 32  # remembered, not hashed
    kept.write_text("not a digest")
    assert file_sha256(f, memo) == true
    kept.write_text("ab" * 32)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert file_sha256(f, memo) == true
    g = tmp_path / "n.gguf"
    g.write_bytes(b"other bytes " * 1000)
    os.replace(g, f)
    assert file_sha256(f, memo) == hashlib.sha256(f.read_bytes()).hexdigest() != true


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
    from ninfer.engine._model import Dense

    path = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    output = open_gguf(path).tensor("output.weight", torch.float32)
    for weights in ("dense", "int4"):
        m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=64,
                       weights=weights)  # fmt: skip
        head = m.transformer.lm_head
        assert isinstance(head, Dense)
        assert torch.equal(head.weight, output)


def test_the_embedding_is_decoded_row_by_row_to_the_table_values(tmp_path: Path) -> None:
    """The token embedding stays in the file's blocks; rows decoded on demand equal the
    dequantized table's rows exactly, for each block type a file may use."""
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1,
                  gguf.GGMLQuantizationType.F16):  # fmt: skip
        path = write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", embed_type=qtype)
        table = open_gguf(path).tensor("token_embd.weight", torch.float32)
        m = load_model(str(path), dtype=torch.float32, device="cpu", max_positions=64)
        tokens = torch.tensor([[5, 0, 200], [7, 7, table.shape[0] - 1]])
        assert torch.equal(m.transformer.embedding(tokens), table[tokens])
        assert torch.equal(m.transformer.embedding.table(torch.float32, "cpu", chunk=7), table)


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


def _spm(tokens: list[str], scores: list[float], **extra: object) -> TextTokenizer:
    types = [6 if t.startswith("<0x") else 3 if t.startswith("<") else 1 for t in tokens]
    return tokenizer_from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra,
    })  # fmt: skip


def test_sentencepiece_merges_the_best_scored_pair_first() -> None:
    """llama.cpp's SPM tokenizer merges, again and again, the adjacent pair whose merged
    piece has the highest score: "abc" is a + bc when bc outscores ab, ab + c otherwise."""
    base = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]
    for ab, bc, pieces in ((-10.0, -5.0, ["a", "bc"]), (-5.0, -10.0, ["ab", "c"])):
        tok = _spm(
            base,
            [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, ab, bc],
            **{"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_space_prefix": False},
        )
        assert [base[i] for i in tok.encode("abc")] == pieces


def test_a_sentencepiece_merge_order_is_kept_and_read_back(tmp_path: Path) -> None:
    """With a directory to keep it in, the merge order is written once and read back by
    the next build (a planted order is what the tokenizer then merges by: ab + c where
    the scores say a + bc); the tokenizer is the same as one built without it; a file
    of another length or with an id outside the vocabulary is not believed."""
    base = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -10.0, -5.0]
    plain = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_space_prefix": False}
    kept = tmp_path / "tokenizers"

    def built(**extra: object) -> TextTokenizer:
        types = [3 if t.startswith("<") else 1 for t in base]
        return tokenizer_from_metadata({
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": base,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **plain,
        }, **extra)  # type: ignore[arg-type]  # fmt: skip

    alone = built()
    first = built(merges_kept=str(kept))
    (order,) = kept.glob("*.merges")
    assert first.tokenizer.to_str() == alone.tokenizer.to_str()
    assert [base[i] for i in built(merges_kept=str(kept)).encode("abc")] == ["a", "bc"]
    np.asarray([2, 3, 4, 4, 5], dtype="<i4").tofile(order)  # a + b first, then b + c
    assert [base[i] for i in built(merges_kept=str(kept)).encode("abc")] == ["ab", "c"]
    for spoiled in ([3, 3, 4], [2, 3, 4, 4, 99], [2, -1, 4, 4, 5]):
        np.asarray(spoiled, dtype="<i4").tofile(order)
        again = built(merges_kept=str(kept))
        assert again.tokenizer.to_str() == alone.tokenizer.to_str()
        assert np.fromfile(order, dtype="<i4").tolist() == [2, 4, 5, 3, 4]


def test_sentencepiece_vocabulary_of_a_gemma_file(tmp_path: Path) -> None:
    """Gemma's kind: spaces as U+2581, no space prefix, BOS first (once), a character no
    piece covers spelled as its UTF-8 bytes; decoding and the streamed bytes give the
    text back."""
    from ninfer.engine._gguf_reader import read_gguf

    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3")
    md, _ = read_gguf(str(path))
    tokens = md["tokenizer.ggml.tokens"]
    tok = tokenizer_from_metadata(md)
    text = "the capital of France is Paris\nété"
    ids = tok.encode(text)
    assert [tokens[i] for i in ids] == [
        "<bos>", "t", "h", "e", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "\n",
        "<0xC3>", "<0xA9>", "t", "<0xC3>", "<0xA9>",
    ]  # fmt: skip
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == text.encode()
    assert tok.encode("<bos>the")[:2] == [2, tokens.index("t")]  # a template's BOS: not twice
    assert tok.count(text) == len(ids)
    assert {tokens[i] for i in tok.eos_ids} == {"<eos>", "<end_of_turn>"}


def test_sentencepiece_with_a_space_prefix() -> None:
    """Llama 2's kind: a space is put before the text (so its first word is a word
    piece) and taken off again when decoding."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h", "▁hi"]
    tok = _spm(tokens, [0.0, 0.0, 0.0, -1, -2, -3, -4, -5])  # the defaults: prefix, BOS
    ids = tok.encode("hi hi")
    assert [tokens[i] for i in ids] == ["<s>", "▁hi", "▁hi"]
    assert tok.decode(ids) == "hi hi"


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
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        _same_as_gguf_reader(write_tiny_gguf(tmp_path / f"{arch}.gguf", architecture=arch))
    _same_as_gguf_reader(write_tiny_gguf(tmp_path / "untied.gguf", tied=False, rope_freqs=True))
    _same_as_gguf_reader(write_k_quant(tmp_path / "k.gguf", "Q6_K", rows=2, cols=256))


def test_a_file_that_is_not_gguf_is_refused_by_the_reader(tmp_path: Path) -> None:
    from ninfer.engine._gguf_reader import read_gguf

    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(str(path))


def _tokenizers(tmp_path: Path) -> dict[str, TextTokenizer]:
    """The tiny model's vocabulary under each byte-level pre-tokenizer ninfer builds, and
    the tiny Gemma's SentencePiece one."""
    from ninfer.engine._gguf_reader import read_gguf

    md, _ = read_gguf(str(write_tiny_gguf(tmp_path / "t.gguf")))
    out = {pre: tokenizer_from_metadata({**md, "tokenizer.ggml.pre": pre})
           for pre in ("smollm", "gpt2", "llama-bpe", "qwen2")}  # fmt: skip
    gemma, _ = read_gguf(str(write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3")))
    out["sentencepiece"] = tokenizer_from_metadata(gemma)
    return out


@pytest.fixture(scope="module")
def every_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TextTokenizer]:
    return _tokenizers(tmp_path_factory.mktemp("tokenizers"))


_PIECES = ["a", "b", "é", "1", "23", " ", "  ", "\n", "\t", "'s", "!", ".", "x y", "<|im_end|>"]


@settings(max_examples=150)
@example(parts=[], limit=0, special=True)  # a BOS-adding vocabulary's empty text: 1 token
@given(
    parts=st.lists(st.sampled_from(_PIECES), max_size=80),
    limit=st.integers(0, 60),
    special=st.booleans(),
)
def test_counting_in_pieces_is_counting_the_ids(
    every_tokenizer: dict[str, TextTokenizer], parts: list[str], limit: int, special: bool
) -> None:
    """`exceeds` (the count in pieces, cut where the pre-tokenizer always cuts, here
    every few characters) says what the ids say, for every kind of vocabulary; and the
    pieces a byte-level text is cut into encode to the text's own ids."""
    import ninfer.engine._tokenizer as tokenizer_module

    text = "".join(parts)
    real = tokenizer_module.PIECE_CHARS
    tokenizer_module.PIECE_CHARS = 3
    try:
        for name, tok in every_tokenizer.items():
            ids = tok.encode(text) if special else tok.encode_plain(text)
            assert tok.exceeds(text, limit, special=special) == (len(ids) > limit), name
            pieces = list(tok._pieces(text))
            assert "".join(pieces) == text
            if tok.pieces_at_spaces:
                joined = [i for p in pieces for i in tok.tokenizer.encode(p).ids]
                assert joined == tok.tokenizer.encode(text).ids, (name, pieces)
            else:
                assert pieces == [text], name  # SentencePiece: counted whole
    finally:
        tokenizer_module.PIECE_CHARS = real


def test_a_text_far_over_the_limit_is_given_up_on_within_a_piece_of_it(
    every_tokenizer: dict[str, TextTokenizer],
) -> None:
    """A byte-level vocabulary counts a 1.2 MB text only until the count passes the
    limit: the characters it encodes are the limit's worth and a piece more, whatever
    the machine's speed (the same text whole: every character)."""
    from ninfer.engine._tokenizer import PIECE_CHARS

    tok = every_tokenizer["smollm"]
    text = "hello world, the capital of France is Paris. " * 27_000  # 1.2 MB
    with counting_tokenizer(tok) as seen:
        assert tok.exceeds(text, 4096)
        assert not tok.exceeds("hello world", 4096)
    per_token = len("hello world") / len(tok.encode_plain("hello world"))
    assert sum(seen) <= 4096 * per_token + 2 * PIECE_CHARS + len("hello world")
