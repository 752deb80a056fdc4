"""Chat templates by name, for a model whose file carries none (`--chat-template`):
ChatML (SmolLM2, Qwen) and Gemma 3's published template. A template is data the
model's tokenizer renders in its sandbox; these are the texts the models' own
tokenizer_config.json files publish."""

from __future__ import annotations

from pathlib import Path

from ninfer._errors import ConfigError

__all__ = ["CHATML", "GEMMA3_TEMPLATE", "NAMED_TEMPLATES", "chat_template_source"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma 3's published chat template (google/gemma-3-*-it, tokenizer_config.json).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

NAMED_TEMPLATES = {"chatml": CHATML, "gemma3": GEMMA3_TEMPLATE}


def chat_template_source(value: str | None) -> str | None:
    """`--chat-template`'s Jinja text: a name (chatml, gemma3) or a file's path; None:
    the model file's own. An unreadable file is a one-line ConfigError."""
    if value is None:
        return None
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise ConfigError(
            f"--chat-template {value!r}: neither a known name "
            f"({', '.join(NAMED_TEMPLATES)}) nor a readable file ({reason})"
        ) from None
    if not text.strip():
        raise ConfigError(f"--chat-template {value!r}: the file is empty")
    return text
