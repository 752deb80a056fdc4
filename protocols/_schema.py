"""JSON Schema from the attrs classes the protocols parse with (and describe answers with).

A field's type gives its JSON type; `schema(...)` puts the documented limits in the
field's metadata (`minimum`, `maximum`, `exclusiveMinimum`, `maxItems`, `minLength`, ...,
and a fixed `default`), so the OpenAPI document states them from the same class that
parses. Request objects refuse unknown fields (`additionalProperties: false`), as the
strict converters do; whether an optional field may be `null` is the protocol's rule.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import attrs

from protocols._errors import ApiError

__all__ = ["Schemas", "check_limits", "schema"]


def schema(**keywords: Any) -> dict[str, Any]:
    """attrs field metadata carrying JSON Schema keywords for the field:
    `attrs.field(default=None, metadata=schema(minimum=0, maximum=2))`. On an optional
    field (None: the server decides), a `default` keyword documents what it then uses."""
    return {"schema": keywords}


class Schemas:
    """Collects component schemas (by class name) while converting classes."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Any]] = {}
        self._classes: dict[str, type] = {}

    def ref(self, cls: type, *, request: bool, nullable: bool = False) -> dict[str, Any]:
        """A `$ref` to `cls`, converting it (and what it uses) on first sight."""
        name = cls.__name__
        if self._classes.setdefault(name, cls) is not cls:
            raise ValueError(f"two schema classes are named {name}")
        if name not in self.components:
            self.components[name] = {}  # placeholder against recursion
            self.components[name] = self._object(cls, request=request, nullable=nullable)
        return {"$ref": f"#/components/schemas/{name}"}

    def _object(self, cls: type, *, request: bool, nullable: bool) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        props: dict[str, Any] = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            extra = dict(field.metadata.get("schema", {}))
            if extra.pop("refused", False):
                continue  # parsed only to be refused by name: not part of the contract
            # A tag the class fixes (`type`, `object`) is always written: required.
            optional = field.default is not attrs.NOTHING and not field.metadata.get("tag")
            schema = self.of(hints[field.name], request=request, nullable=nullable)
            if optional and field.default is not None and "default" not in extra:
                extra["default"] = field.default
            schema = _merge(schema, extra)
            props[field.name] = schema
            if not optional:
                required.append(field.name)
        out: dict[str, Any] = {"type": "object", "properties": props}
        if required:
            out["required"] = required
        if request:
            out["additionalProperties"] = False
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out["description"] = " ".join(cls.__doc__.split())
        return out

    def of(self, hint: Any, *, request: bool, nullable: bool) -> dict[str, Any]:
        """The schema of one type annotation."""
        origin = typing.get_origin(hint)
        if hint is Any:
            return {}
        if hint is type(None):
            return {"type": "null"}
        if origin in (Union, types.UnionType):
            parts = [a for a in typing.get_args(hint) if a is not type(None)]
            has_none = len(parts) != len(typing.get_args(hint))
            schemas = [self.of(p, request=request, nullable=nullable) for p in parts]
            if has_none and (nullable or not request):
                schemas.append({"type": "null"})
            return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if origin is Literal:
            values = list(typing.get_args(hint))
            return {"enum": values}
        if origin is list:
            (item,) = typing.get_args(hint)
            return {"type": "array", "items": self.of(item, request=request, nullable=nullable)}
        if origin is dict:
            return {"type": "object"}
        if hint is bool:
            return {"type": "boolean"}
        if hint is int:
            return {"type": "integer"}
        if hint is float:
            return {"type": "number"}
        if hint is str:
            return {"type": "string"}
        if attrs.has(hint):
            return self.ref(hint, request=request, nullable=nullable)
        raise TypeError(f"no JSON Schema for {hint!r}")


def _merge(schema: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Attach keywords; with `anyOf`, numeric/array/string keywords go on the matching
    branch (JSON Schema applies them only to values of their type anyway)."""
    if not extra:
        return schema
    if "anyOf" not in schema:
        return _onto(schema, extra)
    branches = []
    for branch in schema["anyOf"]:
        kind = branch.get("type")
        branches.append(_onto(branch, {k: v for k, v in extra.items() if _applies(k, kind)}))
    rest = {k: v for k, v in extra.items() if _applies(k, None)}
    return {"anyOf": branches, **rest}


def _onto(schema: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` on `schema`; an `items` keyword refines the array's own item schema."""
    out = {**schema, **extra}
    if "items" in extra and "items" in schema:
        out["items"] = {**schema["items"], **extra["items"]}
    return out


_NUMERIC = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_ARRAY = {"minItems", "maxItems", "items"}
_STRING = {"minLength", "maxLength", "pattern"}


def _applies(keyword: str, kind: str | None) -> bool:
    if keyword in _NUMERIC:
        return kind in ("integer", "number")
    if keyword in _ARRAY:
        return kind == "array"
    if keyword in _STRING:
        return kind == "string"
    return kind is None  # default, description, ...: on the property itself


def check_limits(obj: Any, path: str = "") -> None:
    """Refuse a parsed request whose values break the limits declared in its fields'
    `schema(...)` metadata (the same keywords the OpenAPI document shows), naming the
    parameter by path (`stop[1]`). Nested attrs objects and lists of them are checked
    too. Types are the converter's business; `enum` is each protocol's (it refuses an
    unsupported kind by name)."""
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        if value is None:
            continue
        where = f"{path}.{field.name}" if path else field.name
        keywords = field.metadata.get("schema", {})
        if not keywords.get("refused"):
            problem = _limit_problem(value, keywords)
            if problem is None and isinstance(value, list) and "items" in keywords:
                for i, item in enumerate(value):
                    problem = _limit_problem(item, keywords["items"])
                    if problem is not None:
                        where = f"{where}[{i}]"
                        break
            if problem is not None:
                raise ApiError(
                    "invalid_request", f"{where} {problem}", param=where, code="invalid_value"
                )
        if attrs.has(type(value)):
            check_limits(value, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if attrs.has(type(item)):
                    check_limits(item, f"{where}[{i}]")


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


_BOUNDS = (
    ("minimum", "at least"),
    ("exclusiveMinimum", "greater than"),
    ("maximum", "at most"),
    ("exclusiveMaximum", "less than"),
)


def _within(key: str, value: float, bound: float) -> bool:
    if key == "minimum":
        return value >= bound
    if key == "exclusiveMinimum":
        return value > bound
    if key == "maximum":
        return value <= bound
    return value < bound


def _limit_problem(value: Any, keywords: dict[str, Any]) -> str | None:
    """What is wrong with `value` under the JSON Schema `keywords` that apply to its
    JSON type, as the end of a sentence; None when nothing is."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        conds = []
        broken = False
        for key, word in _BOUNDS:
            if key in keywords:
                bound = keywords[key]
                conds.append(f"{word} {_num(bound)}")
                broken = broken or not _within(key, value, bound)
        return f"must be {' and '.join(conds)}" if broken else None
    if isinstance(value, str):
        low, high = keywords.get("minLength"), keywords.get("maxLength")
        if (low is not None and len(value) < low) or (high is not None and len(value) > high):
            if low == 1 and high is None:
                return "must be a non-empty string"
            bounds = [f"at least {low}" if low else "", f"at most {high}" if high else ""]
            return f"must be {' and '.join(b for b in bounds if b)} characters long"
        return None
    if isinstance(value, list):
        low, high = keywords.get("minItems"), keywords.get("maxItems")
        if low is not None and len(value) < low:
            return f"must contain at least {low} item{'s' if low != 1 else ''}"
        if high is not None and len(value) > high:
            return f"takes at most {high} items; {len(value)} were sent"
    return None
