"""The chat templates GGUF files carry, rendered as transformers renders them: Qwen 2.5's
(undefined `tools`, `message.tool_calls` of plain messages, `loop` lookbacks), Gemma 3's
(system text folded into the first user turn, `trim`, the alternation check), and the
environment's filters and globals; still inside Jinja's sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from conftest import QWEN25
from server import serve, serve_model
from tinymodel import CHATML, GEMMA3_TEMPLATE, write_tiny_gguf

from ninfer.engine._tokenizer import ChatTemplate


def _template(source: str, bos: str = "") -> ChatTemplate:
    return ChatTemplate.from_source(source, bos_token=bos, eos_token="")


def test_qwen25_renders_with_its_default_system_prompt() -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]  # fmt: skip
    assert _template(QWEN25).render(turns) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _template(QWEN25).render(system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_gemma3_folds_the_system_text_into_the_first_turn() -> None:
    t = _template(GEMMA3_TEMPLATE, bos="<bos>")
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi \n"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert t.render(turns) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_tojson_keeps_text_as_it_is_and_the_sandbox_holds() -> None:
    t = _template("{{ messages[0] | tojson }}")
    message = {"role": "user", "content": "<b>&'é"}
    assert json.loads(t.render([message])) == message
    assert "<b>&'é" in t.render([message])  # not \\u003c... as Jinja's own filter writes
    date = _template("{{ strftime_now('%Y') }}").render([])
    assert date.isdigit()
    escape = _template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template error"):
        escape.render([])


async def test_a_template_refusal_is_a_400_naming_messages(tmp_path: Path) -> None:
    """Gemma's template refuses two user turns in a row: the client gets a 400 that names
    `messages` (not a 500); a conversation it accepts is answered."""
    model = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3")
    with trio.fail_after(120):
        async with serve_model(model, tmp_path) as server, server.client() as client:
            name = (await client.get("/v1/models")).json()["data"][0]["id"]
            twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
            bad = {"model": name, "max_tokens": 2, "messages": twice}
            r = await client.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "messages"
            good = {**bad, "messages": [{"role": "system", "content": "s"},
                                        {"role": "user", "content": "the capital"}]}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=good)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 5


async def test_a_template_less_model_is_given_one_by_chat_template(tmp_path: Path) -> None:
    """A base model's file has no chat template (Gemma 3 270M's has none): the chat
    routes refuse it, until --chat-template names one (chatml, gemma3) or a Jinja file;
    /props shows it. A name that is neither is refused at start-up in one line."""
    from ninfer._config import build_config
    from ninfer._errors import ConfigError

    base = write_tiny_gguf(tmp_path / "base.gguf", chat_template=False)
    body = {"model": "tiny-test-llama", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with serve(base, tmp_path) as srv, srv.client() as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "no_chat_template")
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(CHATML)
    for given in ("chatml", str(jinja)):
        async with serve(base, tmp_path, chat_template=given) as srv, srv.client() as c:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            props = (await c.get("/props")).json()
            assert props["chat_template"] == CHATML
            assert props["capabilities"]["chat"] is True
    with pytest.raises(ConfigError, match="--chat-template 'nope': neither a known name"):
        build_config({"model": str(base), "chat_template": "nope"})
