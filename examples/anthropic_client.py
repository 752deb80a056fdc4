"""Use ninfer through the official anthropic SDK: change only the base URL.

.venv/bin/python examples/anthropic_client.py [http://127.0.0.1:8080]

`model` must be a name the server serves (its public id, or an alias given with
--served-model-name); NINFER_MODEL overrides the default model's name.
"""

from __future__ import annotations

import os
import sys

import anthropic


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
    client = anthropic.Anthropic(base_url=base, api_key=os.environ.get("NINFER_API_KEY", "unused"))
    model = os.environ.get("NINFER_MODEL", "smollm2-135m-instruct")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    print(client.messages.count_tokens(model=model, messages=messages))  # type: ignore[arg-type]
    # A question with one right answer: greedy (temperature 0), the same reply every time.
    # The 2.x SDK has no temperature argument (Anthropic's API version 2026-10-21 dropped
    # it); ninfer still honours it in the body, as older clients send it.
    reply = client.messages.create(
        model=model,
        max_tokens=64,
        extra_body={"temperature": 0},
        system="Answer in one sentence.",
        messages=messages,  # type: ignore[arg-type]
    )
    print(reply.content[0].text, reply.stop_reason, reply.usage)  # type: ignore[union-attr]

    # A poem: sampled (Anthropic's default temperature, 1.0), different each time.
    with client.messages.stream(
        model=model,
        max_tokens=64,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
