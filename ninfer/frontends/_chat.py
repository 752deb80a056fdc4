"""One chat pipeline for every chat protocol (OpenAI's chat completions, Anthropic's
messages, OpenAI's Responses; llama-server's /apply-template).

Each protocol maps its body to one protocol-neutral `ChatCall` (its own checks first:
the fields only it has, the tools it offers, a stored conversation to go on from),
then `prepare_chat` runs the same steps in the same order for all of them, so the
first refusal a client sees and the work spent on a bad request do not depend on the
protocol:

1. the model name (404 for one not served);
2. thinking: what the request asked against what the template can do;
3. the grammar of the answer: the tools offered (each one's schema checked) and the
   response format (compiled on a worker thread), so that what the answer must be is
   refused before any work on the prompt;
4. the chat template over the conversation, with the tools and thinking's switches
   (a long conversation on a worker thread);
5. tokens (a long prompt on a worker thread);
6. the one budget check: prompt plus output against the context window and the KV
   pool (refused, or clamped where the protocol's clients send large defaults);
7. how the output is read (reasoning apart, calls) and request_start's fields.

Counting routes (`count_tokens`, `input_tokens`) and /apply-template run its first
half (`chat_prompt`: 1, 2, the tools offered, 4, 5): they compile no grammar. What
the protocol then builds (its engine requests, n choices, its answer) is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ninfer.engine import ChatText, CompiledGrammar
from ninfer.frontends._base import Frontend
from ninfer.frontends._budget import Grant
from ninfer.frontends._output import Reading
from ninfer.frontends._reasoning import ThinkingAsk, ThinkingMode
from ninfer.frontends._tools import ToolPlan

__all__ = ["ChatCall", "ChatPrompt", "PreparedChat", "chat_prompt", "prepare_chat"]


@attrs.frozen(kw_only=True)
class ChatCall:
    """A chat request in no protocol's words."""

    model: str | None  # as the request named it (None: the served model)
    conversation: Sequence[dict[str, Any]]  # {role, content, ...} turns, system first
    # The tools offered and the choice among them (None: no tools), checked when the
    # pipeline reaches them (after the model and thinking).
    plan: Callable[[], ToolPlan | None] = lambda: None
    thinking: ThinkingAsk = attrs.field(factory=ThinkingAsk)
    schema: dict[str, Any] | None = None  # the answer's format (None: free text)
    schema_param: str = ""  # where the request gave it
    requested: int | None = None  # the output budget asked for (None: the default)
    budget_param: str = "max_tokens"  # where the request asked for it
    prompt_param: str = "messages"  # where the conversation is in the request
    clamp: bool = True  # a budget past the room left is cut down (else refused)


@attrs.frozen(kw_only=True)
class ChatPrompt:
    """Steps 1 to 4: the model's name as the request used it, how it thinks, the
    prompt and its tokens."""

    model: str
    thinking: ThinkingMode | None
    plan: ToolPlan | None
    prompt: ChatText
    ids: list[int]


@attrs.frozen(kw_only=True)
class PreparedChat:
    """A chat request through the whole pipeline, ready for its protocol's requests and
    answer."""

    model: str
    thinking: ThinkingMode | None
    plan: ToolPlan | None
    prompt: ChatText
    ids: list[int]
    grant: Grant  # its output budget and what of it is reserved
    grammar: str | CompiledGrammar | None  # what the answer is decoded under
    reading: Reading  # how the output is read
    log_fields: dict[str, Any]  # request_start's fields beyond the engine request's


async def chat_prompt(frontend: Frontend, call: ChatCall) -> ChatPrompt:
    """The pipeline's first half: the model, thinking, the tools, the prompt, its
    tokens."""
    model, thinking, plan = _heads(frontend, call)
    prompt, ids = await _prompt(frontend, call, plan, thinking)
    return ChatPrompt(model=model, thinking=thinking, plan=plan, prompt=prompt, ids=ids)


async def prepare_chat(frontend: Frontend, call: ChatCall, **log_more: Any) -> PreparedChat:
    """The whole pipeline (`log_more`: the protocol's own request_start fields)."""
    model, thinking, plan = _heads(frontend, call)
    grammar = await frontend.output_grammar(plan, call.schema, call.schema_param, thinking)
    prompt, ids = await _prompt(frontend, call, plan, thinking)
    grant = frontend.budget.grant(
        len(ids),
        call.requested,
        param=call.budget_param,
        prompt_param=call.prompt_param,
        clamp=call.clamp,
    )
    calls = plan is not None and plan.calls_allowed
    return PreparedChat(
        model=model,
        thinking=thinking,
        plan=plan,
        prompt=prompt,
        ids=ids,
        grant=grant,
        grammar=grammar,
        reading=frontend.reading(prompt, thinking, tools=calls),
        log_fields=frontend.log_fields(plan, thinking, **log_more),
    )


def _heads(frontend: Frontend, call: ChatCall) -> tuple[str, ThinkingMode | None, ToolPlan | None]:
    """Steps 1 and 2, and the tools offered."""
    model = frontend.ctx.check_model(call.model)
    return model, frontend.thinking(call.thinking), call.plan()


async def _prompt(
    frontend: Frontend, call: ChatCall, plan: ToolPlan | None, thinking: ThinkingMode | None
) -> tuple[ChatText, list[int]]:
    """Steps 4 and 5."""
    prompt = await frontend.render_chat(
        list(call.conversation),
        param=call.prompt_param,
        tools=plan.tools if plan is not None else (),
        thinking=thinking,
    )
    return prompt, await frontend.tokens(prompt, prompt_param=call.prompt_param)
