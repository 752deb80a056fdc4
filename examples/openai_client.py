"""Use ninfer through the official openai SDK: change only the base URL.

.venv/bin/python examples/openai_client.py [http://127.0.0.1:8080]
"""

from __future__ import annotations

import os
import sys

import openai


def main() -> None:
    base = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080") + "/v1"
    client = openai.OpenAI(base_url=base, api_key=os.environ.get("NINFER_API_KEY", "unused"))
    model = client.models.list().data[0].id
    # A question with one right answer: greedy (temperature 0), the same reply every time.
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_completion_tokens=32,
    )
    print(reply.choices[0].message.content)
    print(reply.usage)

    # A poem: sampled (temperature 1.0, the default), and seeded: the same seed gives
    # the same poem, on any batch.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        stream=True,
        stream_options={"include_usage": True},
        seed=7,
        max_completion_tokens=64,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print("\n", chunk.usage)

    # Three sampled choices decoded together, with the log probability of each token.
    three = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a colour."}],
        n=3,
        seed=7,
        max_tokens=8,
        logprobs=True,
    )
    for choice in three.choices:
        lps = (
            [round(t.logprob, 2) for t in (choice.logprobs.content or [])]
            if choice.logprobs
            else []
        )
        print(choice.index, repr(choice.message.content), lps)

    # The Responses API: a stored answer, continued by its id (the prefix cache serves
    # the part of the prompt the two share).
    first = client.responses.create(
        model=model, input="What is the capital of France?", temperature=0, max_output_tokens=32
    )
    print(first.output_text)
    again = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input="And of Italy?",
        temperature=0,
        max_output_tokens=32,
    )
    cached = again.usage.input_tokens_details.cached_tokens if again.usage else 0
    print(again.output_text, f"({cached} prompt tokens from the cache)")

    # A tool call: its arguments always parse and match the function's schema (the
    # answer is decoded under a grammar made from it); the result goes back as a tool
    # message for the model to answer from (SmolLM2 was never trained for tools: its
    # answer is weak; the exchange is the one a tool-trained model needs).
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
    question = {"role": "user", "content": "What is the weather in Paris?"}
    asked = client.chat.completions.create(
        model=model,
        messages=[question],
        tools=[weather],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_completion_tokens=64,
    )
    call = (asked.choices[0].message.tool_calls or [])[0]
    print(asked.choices[0].finish_reason, call.function.name, call.function.arguments)
    answered = client.chat.completions.create(
        model=model,
        messages=[
            question,
            asked.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
        ],
        tools=[weather],
        temperature=0,
        max_completion_tokens=32,
    )
    print(answered.choices[0].message.content)

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], reasoning_effort="low"
        )
    except openai.BadRequestError as exc:
        print("refused:", exc.code, exc.param)


if __name__ == "__main__":
    main()
