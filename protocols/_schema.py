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

__all__ = ["Schemas", "schema"]


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
            optional = field.default is not attrs.NOTHING
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
