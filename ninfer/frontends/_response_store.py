"""The Responses API's local store: stored Responses (what GET returns, their input
Items, the conversation a continuation starts from), bounded by count and by bytes,
least recently used first out; and the listing of a stored Response's input Items."""

from __future__ import annotations

import collections
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from ninfer.frontends._tools import ToolCallTurn
from protocols import (
    ApiError,
    Encoder,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItemList,
    InputMessage,
    ReasoningItem,
    ResponseObject,
)

__all__ = [
    "INPUT_ITEMS_MAX_LIMIT",
    "Item",
    "ResponseStore",
    "Stored",
    "Turn",
    "input_item_page",
    "not_found",
    "stored_size",
    "text_bytes",
]

INPUT_ITEMS_MAX_LIMIT = 100


@attrs.frozen
class Turn:
    """One turn of a conversation, as the chat template takes it: a message, an
    assistant's calls (with its text, if any), or a call's output (role `tool`)."""

    role: str
    text: str
    calls: tuple[ToolCallTurn, ...] = ()
    call_id: str | None = None  # of a tool turn
    reasoning: str | None = None  # of an assistant turn of a thinking model

    def message(self) -> dict[str, Any]:
        turn: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.calls:
            turn["tool_calls"] = list(self.calls)
        if self.call_id is not None:
            turn["tool_call_id"] = self.call_id
        if self.reasoning is not None:
            turn["reasoning_content"] = self.reasoning
        return turn


Item = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def text_bytes(history: Sequence[Turn]) -> int:
    """The UTF-8 bytes of a conversation's texts: its turns and their calls."""
    texts = [t.text for t in history] + [t.reasoning for t in history if t.reasoning]
    texts += [orjson.dumps(c.arguments).decode() for t in history for c in t.calls]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def stored_size(
    encoder: Encoder, response: ResponseObject, items: Sequence[Item], history: Sequence[Turn]
) -> int:
    """What a stored Response costs the store: the whole Response as GET serves it (its
    instructions, tools and `text.format` schema with it), its input Items as their
    listing serves them, and the texts of the conversation a continuation starts from."""
    return (
        len(encoder.json(response))
        + sum(len(encoder.json(item)) for item in items)
        + text_bytes(history)
    )


@attrs.frozen
class Stored:
    """A stored Response: what GET returns, its input Items, and the conversation a
    continuation starts from (its chain's history, its input, its output), with what it
    costs the store (`stored_size`, counted once, when stored)."""

    response: ResponseObject
    input_items: tuple[Item, ...]
    history: tuple[Turn, ...]
    size: int


class ResponseStore:
    """Stored Responses in this process only (lost on restart): the least recently used
    are dropped past `max_records` or `max_bytes`."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, stored: Stored) -> bool:
        """Keep `stored` (False: it alone is larger than the store)."""
        size = stored.size
        if size > self.max_bytes:
            return False
        self.delete(stored.response.id)
        self._items[stored.response.id] = stored
        self._bytes += size
        while len(self._items) > self.max_records or self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= dropped.size
        return True

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._bytes -= stored.size
        return True


def not_found(param: str | None = None) -> ApiError:
    return ApiError(
        "not_found",
        "no stored response has this id (store was false, or it was deleted or evicted)",
        param=param,
        code="response_not_found",
    )


def _query(raw: bytes) -> dict[str, str]:
    """A query string's parameters, each given once at most."""
    text = raw.decode("latin-1")
    try:
        pairs = urllib.parse.parse_qs(text, strict_parsing=bool(text), max_num_fields=16)
    except ValueError:
        raise ApiError(
            "invalid_request", "the query string cannot be read", code="invalid_value"
        ) from None
    if any(len(v) > 1 for v in pairs.values()):
        raise ApiError("invalid_request", "a query parameter is given twice", code="invalid_value")
    return {k: v[0] for k, v in pairs.items()}


def input_item_page(stored: Stored, query_string: bytes) -> InputItemList:
    """A page of a stored Response's input Items: `after` (an Item id), `limit` 1..100
    (default 20), `order` asc or desc (default desc, as OpenAI's)."""
    query = _query(query_string)
    unknown = sorted(set(query) - {"after", "limit", "order", "include"})
    if unknown:
        raise ApiError(
            "invalid_request",
            "unknown query parameter; this route takes after, limit and order",
            param=unknown[0] if unknown[0].isidentifier() else None,
            code="unknown_parameter",
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError("invalid_request", "order must be asc or desc", param="order",
                       code="invalid_value")  # fmt: skip
    raw = query.get("limit", "20")
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= INPUT_ITEMS_MAX_LIMIT:
        raise ApiError(
            "invalid_request",
            f"limit must be an integer from 1 to {INPUT_ITEMS_MAX_LIMIT}",
            param="limit",
            code="invalid_value",
        )
    if query.get("include"):
        raise ApiError("invalid_request", "include is not supported here",
                       param="include", code="unsupported_parameter")  # fmt: skip
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if "after" in query:
        ids = [i.id for i in items]
        if query["after"] not in ids:
            raise ApiError("invalid_request", "after names no Item of this response",
                           param="after", code="invalid_value")  # fmt: skip
        items = items[ids.index(query["after"]) + 1 :]
    page = items[: int(raw)]
    return InputItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(items) > len(page),
    )
