"""Is a new OpenAPI document a compatible change of an old one?

Requests: compatible when the new schema accepts everything the old one accepted, with
the same meaning: a raised limit or a new optional field is; a lowered limit, a removed
field or type, a new required field or a changed default is not. Responses (and stream
events): compatible when a tolerant reader of the old schema still reads everything the
new one can produce: a new field is; a new enum value or type, or a field that is no
longer always present, is not. Each break names the rule and where it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Break", "classify"]

Schema = dict[str, Any]


@attrs.frozen
class Break:
    where: str
    rule: str

    def __str__(self) -> str:
        return f"{self.where}: {self.rule}"


class _Docs:
    def __init__(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        self.old = old
        self.new = new
        self.breaks: list[Break] = []
        self._seen: set[tuple[int, int, str]] = set()

    def resolve(self, doc: dict[str, Any], schema: Schema) -> Schema:
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            schema = doc["components"]["schemas"][name]
        return schema

    def brk(self, where: str, rule: str) -> None:
        self.breaks.append(Break(where, rule))


def _branches(schema: Schema) -> list[Schema]:
    return list(schema["anyOf"]) if "anyOf" in schema else [schema]


def _match(
    d: _Docs,
    doc: dict[str, Any],
    candidates: list[Schema],
    raw: Schema,
    target: Schema,
    fits: Callable[[str, str], bool],
) -> Schema | None:
    """The branch among `candidates` that corresponds to `target`: the same named
    component if there is one, else the first of a fitting kind."""
    if "$ref" in raw:
        for c in candidates:
            if c.get("$ref") == raw["$ref"]:
                return d.resolve(doc, c)
    kind = _kind(target)
    fitting = [r for r in (d.resolve(doc, c) for c in candidates) if fits(_kind(r), kind)]
    if kind == "array" and len(fitting) > 1 and "items" in target:
        # Several arrays (strings, token ids, ...): the one whose items are of a fitting kind.
        items = _kind(d.resolve(doc, target["items"]))
        for r in fitting:
            if "items" in r and fits(_kind(d.resolve(doc, r["items"])), items):
                return r
    return fitting[0] if fitting else None


def _kind(schema: Schema) -> str:
    """A branch's kind: its JSON type, or `enum`/`any`."""
    if "type" in schema:
        return str(schema["type"])
    if "enum" in schema or "const" in schema:
        return "enum"
    return "any" if not schema else "object" if "properties" in schema else "any"


def _accepts_kind(new_kind: str, old_kind: str) -> bool:
    return (
        new_kind == old_kind
        or new_kind == "any"
        or (new_kind, old_kind)
        == (
            "number",
            "integer",
        )
    )


def _values(schema: Schema) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if "enum" in schema else None


_LOWER = ("minimum", "exclusiveMinimum", "minItems", "minLength")
_UPPER = ("maximum", "exclusiveMaximum", "maxItems", "maxLength")


def _request(d: _Docs, old: Schema, new: Schema, where: str) -> None:
    old, new = d.resolve(d.old, old), d.resolve(d.new, new)
    key = (id(old), id(new), "req")
    if key in d._seen:
        return
    d._seen.add(key)
    if old.get("default", None) != new.get("default", None):
        d.brk(where, f"a default changed ({old.get('default')!r} -> {new.get('default')!r})")
    for raw in _branches(old):
        ob = d.resolve(d.old, raw)
        match = _match(d, d.new, _branches(new), raw, ob, _accepts_kind)
        if match is None:
            d.brk(where, f"a request type was removed (no longer accepts {_kind(ob)})")
            continue
        _request_branch(d, ob, match, where)


def _request_branch(d: _Docs, old: Schema, new: Schema, where: str) -> None:
    old_vals, new_vals = _values(old), _values(new)
    if old_vals is not None and new_vals is not None:
        gone = [v for v in old_vals if v not in new_vals]
        if gone:
            d.brk(where, f"an accepted value was removed ({gone!r})")
    elif old_vals is None and new_vals is not None:
        d.brk(where, "a request field was restricted to fixed values")
    for k in _LOWER:
        if k in new and (k not in old or new[k] > old[k]):
            d.brk(where, f"a lower limit was raised ({k} {old.get(k)} -> {new[k]})")
    for k in _UPPER:
        if k in new and (k not in old or new[k] < old[k]):
            d.brk(where, f"an upper limit was lowered ({k} {old.get(k)} -> {new[k]})")
    if "items" in old and "items" in new:
        _request(d, old["items"], new["items"], where + "[]")
    if "properties" in old or "properties" in new:
        _request_object(d, old, new, where)


def _request_object(d: _Docs, old: Schema, new: Schema, where: str) -> None:
    op, np_ = old.get("properties", {}), new.get("properties", {})
    oreq, nreq = set(old.get("required", [])), set(new.get("required", []))
    closed_new = new.get("additionalProperties", True) is False
    if closed_new and old.get("additionalProperties", True) is not False:
        d.brk(where or "body", "unknown fields are now refused")
    for name, sub in op.items():
        path = f"{where}.{name}" if where else name
        if name not in np_:
            if closed_new:
                d.brk(path, "a request field was removed")
            continue
        if name in nreq and name not in oreq:
            d.brk(path, "a field became required")
        _request(d, sub, np_[name], path)
    for name in np_:
        if name not in op and name in nreq:
            d.brk(f"{where}.{name}" if where else name, "a new required field")


def _response(d: _Docs, old: Schema, new: Schema, where: str) -> None:
    old, new = d.resolve(d.old, old), d.resolve(d.new, new)
    key = (id(old), id(new), "resp")
    if key in d._seen:
        return
    d._seen.add(key)
    for raw in _branches(new):
        nb = d.resolve(d.new, raw)
        match = _match(d, d.old, _branches(old), raw, nb, _accepts_kind)
        if match is None:
            d.brk(where, f"a response may now be of a type old readers do not expect "
                  f"({_kind(nb)})")  # fmt: skip
            continue
        _response_branch(d, match, nb, where)


def _response_branch(d: _Docs, old: Schema, new: Schema, where: str) -> None:
    old_vals, new_vals = _values(old), _values(new)
    if old_vals is not None:
        if new_vals is None:
            d.brk(where, "a response field is no longer limited to fixed values")
        else:
            added = [v for v in new_vals if v not in old_vals]
            if added:
                d.brk(where, f"a new enum value in a response ({added!r})")
    if "items" in old and "items" in new:
        _response(d, old["items"], new["items"], where + "[]")
    op, np_ = old.get("properties", {}), new.get("properties", {})
    oreq, nreq = set(old.get("required", [])), set(new.get("required", []))
    for name, sub in op.items():
        path = f"{where}.{name}" if where else name
        if name not in np_:
            if name in oreq:
                d.brk(path, "a response field was removed")
            continue
        if name in oreq and name not in nreq:
            d.brk(path, "a response field is no longer always present")
        _response(d, sub, np_[name], path)


_METHODS = ("get", "post", "put", "delete", "patch")


def classify(old: dict[str, Any], new: dict[str, Any]) -> list[Break]:
    """Every incompatible difference from `old` to `new` (empty: compatible)."""
    d = _Docs(old, new)
    for path, ops in old.get("paths", {}).items():
        new_ops = new.get("paths", {}).get(path)
        for method in _METHODS:
            if method not in ops:
                continue
            op_where = f"{method.upper()} {path}"
            if new_ops is None or method not in new_ops:
                d.brk(op_where, "an operation was removed")
                continue
            _operation(d, ops[method], new_ops[method], op_where)
    return d.breaks


def _operation(d: _Docs, old: dict[str, Any], new: dict[str, Any], where: str) -> None:
    old_body = old.get("requestBody", {}).get("content", {}).get("application/json")
    new_body = new.get("requestBody", {}).get("content", {}).get("application/json")
    if old_body is not None:
        if new_body is None:
            d.brk(where, "the JSON request body is no longer accepted")
        else:
            _request(d, old_body["schema"], new_body["schema"], f"{where} request")
    elif new_body is not None and new.get("requestBody", {}).get("required"):
        d.brk(where, "a request body is now required")
    for status, old_resp in old.get("responses", {}).items():
        new_resp = new.get("responses", {}).get(status)
        if new_resp is None:
            continue  # a status that can no longer happen: readers of it are unaffected
        for ctype, old_media in old_resp.get("content", {}).items():
            new_media = new_resp.get("content", {}).get(ctype)
            rwhere = f"{where} {status} {ctype}"
            if new_media is None:
                d.brk(rwhere, "a response content type was removed")
                continue
            _response(d, old_media.get("schema", {}), new_media.get("schema", {}), rwhere)
            _stream(d, old_media, new_media, rwhere)


def _stream(d: _Docs, old: dict[str, Any], new: dict[str, Any], where: str) -> None:
    old_events, new_events = old.get("x-stream-events"), new.get("x-stream-events")
    if old_events is not None:
        new_events = new_events or {}
        for name, schema in old_events.items():
            if name not in new_events:
                d.brk(f"{where} event {name}", "a stream event was removed")
            else:
                _response(d, schema, new_events[name], f"{where} event {name}")
        for name in new_events:
            if name not in old_events:
                d.brk(f"{where} event {name}", "a new stream event old readers do not know")
    if "x-stream-data" in old:
        if "x-stream-data" not in new:
            d.brk(where, "the stream's data lines changed format")
        else:
            _response(d, old["x-stream-data"], new["x-stream-data"], f"{where} data")
