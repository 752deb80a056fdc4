"""Tool calls for every protocol: the prompt that offers the tools, the grammar that makes
every call parse and match its tool's schema, and the parser that reads calls out of
the generated text (whole, or as it streams).

One markup for every model, Hermes' (the one Qwen 2.5 and many tuned models are trained
on): a call is `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, calls are
separated by a newline, and text may come before the first call. A chat template that
writes this markup itself (it names `<tool_call>`) is given the tools and the tool turns
the way transformers gives them; any other template gets the tools described in a system
section of ninfer's own wording, and tool turns written in the same markup
(docs/api.md, "Tools"). The grammar decides what a tool choice allows:

- `auto`: text without any `<tool_call>`, or text followed by calls;
- `required`: one call or more (one when parallel calls are off), nothing before;
- a named tool: exactly one call of that tool;
- `none`: text without any `<tool_call>`.

With a response format, the text alternative is the format's JSON instead.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import llguidance
import orjson

from ninfer.frontends._structured import (
    closed_objects,
    json_schema_grammar,
    rebased,
    think_first,
)
from protocols import ApiError

__all__ = [
    "CallArgs",
    "CallEnd",
    "CallStart",
    "Event",
    "TextPiece",
    "Tool",
    "ToolCallTurn",
    "ToolPlan",
    "ToolStream",
    "call_id",
    "generic_section",
    "held_suffix",
    "render_tool_turns",
    "tool_grammar",
]

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
SEPARATOR = "\n"  # between one call's CLOSE and the next OPEN
# Tool-call JSON is written as Python's json.dumps and transformers' tojson write it (the
# way the history's calls are rendered): ", " between items and ": " after keys.
_CALL_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPACT = {"whitespace_flexible": False}

ChoiceKind = Literal["auto", "required", "none", "named"]


def call_id(prefix: str = "call") -> str:
    """A fresh call id (`call_...` for OpenAI, `toolu_...` for Anthropic)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class Tool:
    """One function a request offers: its name, description and the JSON Schema of its
    arguments object; `param` is where the schema is in the request (for refusals)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    param: str

    @classmethod
    def checked(cls, name: str, description: str | None, parameters: Any, param: str) -> Tool:
        """A request's function, its parameters checked (`param`: where they are)."""
        return cls(name, description, check_parameters(parameters, param), param)

    def spec(self) -> dict[str, Any]:
        """The OpenAI function shape templates and the generic section describe."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@attrs.frozen
class ToolPlan:
    """A request's tools and what its tool choice allows."""

    tools: tuple[Tool, ...]
    choice: ChoiceKind
    parallel: bool
    named: str | None = None  # the tool of a named choice

    @classmethod
    def of(cls, tools: tuple[Tool, ...], choice: str | dict[str, Any] | None,
           parallel: bool) -> ToolPlan:  # fmt: skip
        """A plan from an OpenAI-shaped choice (checked): none, auto (the default),
        required, or a named function ({"function": {"name"}} or {"name"})."""
        if isinstance(choice, dict):
            inner = choice.get("function", choice)
            return cls(tools, "named", parallel, str(inner["name"]))
        kinds: dict[str | None, ChoiceKind] = {
            None: "auto", "auto": "auto", "required": "required", "none": "none"}  # fmt: skip
        return cls(tools, kinds[choice], parallel)

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def log_fields(self) -> dict[str, Any]:
        """request_start's fields for a request that offers tools."""
        return {"tools": len(self.tools), "tool_choice": self.choice}


def check_parameters(schema: Any, param: str) -> dict[str, Any]:
    """A tool's arguments schema: a JSON Schema of an object (absent: no arguments)."""
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ApiError("invalid_request", "a tool's parameters must be a JSON Schema object",
                       param=param, code="invalid_value")  # fmt: skip
    kind = schema.get("type", "object")
    if kind != "object":
        raise ApiError(
            "invalid_request",
            'a tool\'s parameters must describe an object (JSON Schema "type": "object")',
            param=param,
            code="invalid_value",
        )
    return {**schema, "type": "object"}


# ---- the grammar ----------------------------------------------------------------------

# Text that holds no call, and text that ends with the first call's opening.
_TEXT = "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
_LEAD = "LEAD: /(?s:.*)<tool_call>\\n/ & ~/(?s:.*)<tool_call>(?s:.*)<tool_call>(?s:.*)/\n"


def _lark_string(text: str) -> str:
    return orjson.dumps(text).decode()


def _call_schema(tool: Tool) -> dict[str, Any]:
    """A call's JSON: the tool's name, and its arguments under its parameters' schema
    (whose `$ref`s, pydantic's `#/$defs/...`, then point inside `arguments`)."""
    arguments = rebased(closed_objects(tool.parameters), "#/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": _CALL_STYLE,
    }


def tool_grammar(
    plan: ToolPlan, text_schema: dict[str, Any] | None, text_param: str, *, think: bool = False
) -> str:
    """The llguidance grammar of an answer under `plan` (`text_schema`: a response
    format's JSON Schema, at `text_param` in the request, which then replaces free text;
    `think`: after a reasoning block). Each schema is checked alone first, so that a
    refusal names the one at fault. Run off the event loop."""
    for tool in plan.tools:
        json_schema_grammar(tool.parameters, param=tool.param)
    if text_schema is not None:
        json_schema_grammar(text_schema, param=text_param)
    if text_schema is not None:
        text_json = {**closed_objects(text_schema), "x-guidance": _COMPACT}
        text_rule = "text: %json " + orjson.dumps(text_json).decode()
    else:
        text_rule = "text: TEXT"
    lines = ["%llguidance {}"]
    if not plan.calls_allowed:
        lines.append("start: text")
    else:
        tools = [t for t in plan.tools if plan.named is None or t.name == plan.named]
        lead = '"<tool_call>\\n"' if text_schema is not None else "LEAD"
        open_, close = _lark_string(OPEN), _lark_string(CLOSE)
        again = _lark_string(SEPARATOR + OPEN)
        if plan.choice == "auto":
            lines.append(f"start: text | {lead} body")
        else:
            lines.append(f"start: {open_} body")
        # A newline may end the last call (a model that ends its line before its end of
        # turn is not made to start another call).
        if plan.parallel and plan.named is None:
            lines.append(f'body: call {close} ({again} call {close})* "\\n"?')
        else:
            lines.append(f'body: call {close} "\\n"?')
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        for i, tool in enumerate(tools):
            lines.append(f"call_{i}: %json " + orjson.dumps(_call_schema(tool)).decode())
        lines.append(_LEAD)
    lines.append(text_rule)
    lines.append(_TEXT)
    grammar = "\n".join(lines)
    if think:
        grammar = think_first(grammar)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(
            "invalid_request",
            "the tools' schemas cannot be enforced together while decoding",
            param="tools",
            code="invalid_value",
        )
    return grammar


# ---- the prompt ---------------------------------------------------------------------


@attrs.frozen
class ToolCallTurn:
    """A call an assistant turn made, as the history replays it."""

    id: str
    name: str
    arguments: dict[str, Any]


def _dumps(value: Any) -> str:
    """JSON as the history renders it (json.dumps' default separators, UTF-8 kept)."""
    return json.dumps(value, ensure_ascii=False)


def _call_markup(call: ToolCallTurn) -> str:
    return OPEN + _dumps({"name": call.name, "arguments": call.arguments}) + CLOSE


_GENERIC_SECTION = (
    "# Tools\n\n"
    "You can call functions to help answer. Each function is described by one JSON "
    "object per line between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and its arguments "
    "between <tool_call> and </tool_call>, one call per block:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "The results come back between <tool_response> and </tool_response>."
)


def generic_section(tools: Sequence[Tool]) -> str:
    """The system text that offers `tools` to a template without tool support."""
    return _GENERIC_SECTION.format(tools="\n".join(_dumps(t.spec()) for t in tools))


def render_tool_turns(
    turns: Sequence[dict[str, Any]], tools: Sequence[Tool], *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A conversation with tool calls and results (turns: role, content, and
    `tool_calls` (ToolCallTurn) on an assistant turn, `tool_call_id` on a `tool` turn)
    as the messages and `tools` a chat template is given.

    `native`: the template writes the markup itself (transformers' message shapes).
    Otherwise the tools are described in a system section (added to the first system
    turn, or a new one), calls are written into the assistant's text and results are
    user turns of `<tool_response>` blocks (consecutive results share one turn)."""
    if native:
        out = []
        for t in turns:
            m = {k: v for k, v in t.items() if k != "tool_calls"}
            calls: Sequence[ToolCallTurn] = t.get("tool_calls") or ()
            if calls:
                m["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]  # fmt: skip
            out.append(m)
        return out, [tool.spec() for tool in tools] or None
    messages: list[dict[str, Any]] = []
    results = False  # the last message is a user turn of results
    for t in turns:
        if t["role"] == "tool":
            block = f"<tool_response>\n{t['content']}\n</tool_response>"
            if results:
                messages[-1]["content"] += "\n" + block
            else:
                messages.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        content = str(t.get("content") or "")
        calls = t.get("tool_calls") or ()
        if calls:
            content = "\n".join(([content] if content else []) + [_call_markup(c) for c in calls])
        messages.append({"role": t["role"], "content": content})
    if tools:
        section = generic_section(tools)
        if messages and messages[0]["role"] == "system":  # `developer` is `system` here
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{section}"}
        else:
            messages.insert(0, {"role": "system", "content": section})
    return messages, None


# ---- reading the output ---------------------------------------------------------------


@attrs.frozen
class TextPiece:
    text: str


@attrs.frozen
class CallStart:
    index: int
    name: str


@attrs.frozen
class CallArgs:
    index: int
    text: str


@attrs.frozen
class CallEnd:
    index: int


Event = TextPiece | CallStart | CallArgs | CallEnd

_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
_HEAD_MAX = 4096  # a call's head is its name (a tool name) and fixed text


def held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@attrs.define
class ToolStream:
    """Reads text and calls out of an output under a tool grammar, as it arrives.

    Text before a call is given as it comes, but for what could still be the start of a
    call's opening or the blanks before one (a call's text has no trailing blanks).
    A call is announced once its name is complete, its arguments are given as they are
    generated, and it ends when its arguments object closes (the grammar made it parse
    and match the tool's schema by then)."""

    state: Literal["text", "head", "args", "tail", "broken"] = "text"
    buffer: str = ""
    calls: int = 0  # calls started
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        progress = True
        while progress:
            progress = self._step(events)
        return events

    def _step(self, events: list[Event]) -> bool:
        buf = self.buffer
        if self.state == "text":
            at = buf.find(OPEN)
            if at >= 0:
                if buf[:at].rstrip():
                    events.append(TextPiece(buf[:at].rstrip()))
                self.buffer, self.state = buf[at + len(OPEN) :], "head"
                return True
            keep = held_suffix(buf, OPEN)
            body = buf[: len(buf) - keep]
            sent = body.rstrip()
            keep += len(body) - len(sent)
            if sent:
                events.append(TextPiece(sent))
            self.buffer = buf[len(buf) - keep :] if keep else ""
            return False
        if self.state == "head":
            m = _HEAD.match(buf)
            if m is None:
                if len(buf) > _HEAD_MAX or not _could_be_head(buf):
                    self.state = "broken"
                return False
            name = orjson.loads(b'"' + m.group(1).encode() + b'"')
            events.append(CallStart(self.calls, name))
            self.calls += 1
            self.buffer, self.state = buf[m.end() :], "args"
            self.depth, self.in_string, self.escaped = 0, False, False
            return True
        if self.state == "args":
            end = self._scan(buf)
            if end is None:
                if buf:
                    events.append(CallArgs(self.calls - 1, buf))
                self.buffer = ""
                return False
            if end:
                events.append(CallArgs(self.calls - 1, buf[:end]))
            events.append(CallEnd(self.calls - 1))
            self.buffer, self.state = buf[end:], "tail"
            return True
        if self.state == "tail":
            tail = "}" + CLOSE + SEPARATOR + OPEN
            if buf.startswith(tail):
                self.buffer, self.state = buf[len(tail) :], "head"
                return True
            return False
        return False

    def _scan(self, text: str) -> int | None:
        """Where the arguments object ends in `text` (just past its last brace)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None

    def finish(self) -> list[Event]:
        """The text held back, when the output ended as text."""
        if self.state == "text" and self.buffer:
            text, self.buffer = self.buffer, ""
            return [TextPiece(text)]
        return []

    @property
    def open_call(self) -> bool:
        """A call was opened and its arguments never closed (the budget ended it)."""
        return self.state in ("head", "args", "broken")


def _could_be_head(text: str) -> bool:
    prefix = '{"name": "'
    if len(text) <= len(prefix):
        return prefix.startswith(text)
    return text.startswith(prefix)


@attrs.frozen
class ParsedCall:
    name: str
    arguments: str  # the JSON text, as generated
