"""What the three protocols' tool fields share: the rule for a tool's name, and reading a
call's arguments when a client replays it in the history."""

from __future__ import annotations

import re
from typing import Any

import orjson

from protocols._strict import invalid_value, unsupported

__all__ = ["TOOL_NAME", "check_tool_name", "refuse_hosted_tools", "replayed_arguments"]

# OpenAI's and Anthropic's rule for a function's name.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tool_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid_value(param, "a tool's name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
    return name


def replayed_arguments(text: str, param: str) -> dict[str, Any]:
    """The arguments of a call the history replays: JSON text of an object."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise invalid_value(param, "a tool call's arguments must be the JSON text of an object")
    return value


def refuse_hosted_tools(body: Any, served: tuple[str | None, ...]) -> None:
    """Refuse, by its type, a tool of a kind not served (hosted or server tools carry
    fields of their own, which would otherwise be refused one by one as unknown)."""
    tools = body.get("tools") if isinstance(body, dict) else None
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") not in served:
            kind = tool.get("type")
            if isinstance(kind, str):
                raise unsupported(f"tools[{i}].type", "tools of this type are not supported "
                                  "here; only function tools are")  # fmt: skip
