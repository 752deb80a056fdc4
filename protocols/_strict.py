"""Strict structuring of JSON into attrs classes with cattrs.

cattrs is lenient by default ("12" becomes 12, "false" becomes True). Here:
an int is only a JSON integer (never a bool, never 5.0), a float is a JSON number
(an integer is accepted) and finite, a bool is only true/false, a string only a
string; null only where a field is Optional; unknown keys are refused. Every
failure becomes ApiError(invalid_request) naming the parameter by its path
(`messages[2].content`), with code `unknown_parameter`, `invalid_type`,
`missing_required_parameter` or `invalid_value`.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

from protocols._errors import ApiError

__all__ = [
    "InvalidType",
    "InvalidValue",
    "invalid_value",
    "make_converter",
    "register_list",
    "register_text_or_list",
    "structure",
    "to_api_error",
    "unsupported",
]

T = TypeVar("T")


class InvalidType(TypeError):
    """A JSON value of the wrong type; `expected` names the JSON type wanted."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


class InvalidValue(ValueError):
    """A JSON value of the right type but not allowed; the message says what is."""


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _int(value: Any, _: type) -> int:
    if type(value) is not int:
        raise InvalidType("integer")
    return value


def _float(value: Any, _: type) -> float:
    if type(value) is int:
        return float(value)
    if type(value) is not float:
        raise InvalidType("number")
    if not math.isfinite(value):
        raise InvalidValue("must be a finite number")
    return value


def _bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise InvalidType("boolean")
    return value


def _str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise InvalidType("string")
    return value


def _dict(value: Any, _: type) -> dict[str, Any]:
    if type(value) is not dict:
        raise InvalidType("object")
    return value


def make_converter() -> cattrs.Converter:
    """A fresh strict converter; each protocol keeps its own and adds union hooks."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _int)
    conv.register_structure_hook(float, _float)
    conv.register_structure_hook(bool, _bool)
    conv.register_structure_hook(str, _str)
    conv.register_structure_hook_func(lambda t: t == dict[str, Any], _dict)
    return conv


def register_list(conv: cattrs.Converter, item: Any) -> None:
    """Structure list[item] strictly: a JSON array only (cattrs would iterate a string),
    each element failing with its index in the path."""
    target = list[item]

    def hook(value: Any, _: type) -> list[Any]:
        if type(value) is not list:
            raise InvalidType("array")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(conv.structure(v, item))
            except Exception as exc:
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {target} @ index {i}", i, item),
                ]
                raise IterableValidationError(f"While structuring {target}", [exc], list) from None
        return out

    conv.register_structure_hook_func(lambda t: t == target, hook)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")
UNNAMED = "<invalid name>"


def field_name(name: str) -> str:
    """A client-chosen name as it may appear in an answer: itself when it looks like a
    parameter name (up to 64 of [A-Za-z0-9_-]), else a placeholder, so that an error
    never carries arbitrary input back."""
    return name if _NAME.fullmatch(name) else UNNAMED


def kind_name(kind: str, known: frozenset[str]) -> str:
    """A client-sent `type` value for a message: quoted when it is a type we know of."""
    return repr(kind) if kind in known else "this type"


def _path(prefix: str, note: object) -> str:
    if isinstance(note, AttributeValidationNote):
        return f"{prefix}.{note.name}" if prefix else note.name
    if isinstance(note, IterableValidationNote):
        return f"{prefix}[{note.index}]"
    return prefix


def _first_error(exc: BaseException, path: str) -> tuple[str, BaseException]:
    """Descend cattrs' exception groups to the first leaf, building its path."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        with_notes, without = exc.group_exceptions()
        if with_notes:
            sub, note = with_notes[0]
            return _first_error(sub, _path(path, note))
        if without:
            return _first_error(without[0], path)
    if isinstance(exc, BaseValidationError) and exc.exceptions:
        return _first_error(exc.exceptions[0], path)
    return path, exc


def to_api_error(exc: BaseException, value: Any, root: str = "") -> ApiError:
    path, leaf = _first_error(exc, root)
    if isinstance(leaf, ForbiddenExtraKeysError):
        name = field_name(sorted(leaf.extra_fields)[0])
        full = f"{path}.{name}" if path else name
        return ApiError(
            "invalid_request",
            f"unknown parameter: {full}",
            param=full,
            code="unknown_parameter",
        )
    if isinstance(leaf, KeyError):
        return ApiError(
            "invalid_request",
            f"missing required parameter: {path}",
            param=path or None,
            code="missing_required_parameter",
        )
    if isinstance(leaf, InvalidType):
        got = _json_type(_lookup(value, path, root))
        where = path or "the request body"
        return ApiError(
            "invalid_request",
            f"{where} must be of type {leaf.expected}, got {got}",
            param=path or None,
            code="invalid_type",
        )
    if isinstance(leaf, InvalidValue):
        return ApiError("invalid_request", f"{path} {leaf}", param=path, code="invalid_value")
    # A cattrs structuring failure we did not foresee (e.g. a null where none is allowed).
    return ApiError(
        "invalid_request",
        f"{path or 'the request body'} has an invalid value",
        param=path or None,
        code="invalid_value",
    )


def _lookup(value: Any, path: str, root: str) -> Any:
    """The JSON value at `path` (best effort, for naming its type only)."""
    if root and path.startswith(root):
        path = path[len(root) :].lstrip(".")
    cur = value
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        try:
            cur = cur[int(part[1:-1])] if part.startswith("[") else cur[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return cur


# The most entries a request's top-level arrays may hold, checked before they are read:
# chat and Anthropic messages, Responses input Items, and tools (OpenAI documents 128
# functions). A conversation of 2,048 messages is past what the models served here can
# hold in their context; 60,000 took seconds to read.
ARRAY_LIMITS = {"messages": 2048, "input": 2048, "tools": 128}


def structure(conv: cattrs.Converter, value: Any, cls: type[T]) -> T:
    """Structure a parsed JSON body into `cls`, or raise ApiError naming the parameter
    (an array longer than its ARRAY_LIMITS entry is refused before it is read)."""
    if type(value) is not dict:
        raise ApiError(
            "invalid_request",
            f"the request body must be a JSON object, got {_json_type(value)}",
            code="invalid_type",
        )
    for name, most in ARRAY_LIMITS.items():
        entries = value.get(name)
        if type(entries) is list and len(entries) > most:
            raise ApiError(
                "invalid_request",
                f"{name} has {len(entries)} entries; at most {most} are accepted",
                param=name,
                code="array_above_max_length",
            )
    try:
        return conv.structure(value, cls)
    except (BaseValidationError, ForbiddenExtraKeysError, InvalidType, InvalidValue) as exc:
        raise to_api_error(exc, value) from None


def register_text_or_list(conv: cattrs.Converter, item: Any, what: str) -> None:
    """Structure `str | list[item]` (optional or not): a string as is, an array as
    list[item] (registered strictly), anything else refused as "string or array of
    `what`". The protocols' content, stop and input fields take this shape."""
    register_list(conv, item)
    union = str | list[item]

    def hook(value: Any, _: type) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            return conv.structure(value, list[item])
        raise InvalidType(f"string or array of {what}")

    conv.register_structure_hook_func(lambda t: t in (union, union | None), hook)


def invalid_value(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A well-typed value that is not allowed: invalid_request naming the parameter."""
    return ApiError("invalid_request", message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    """A field of the reference this server knows and cannot honour, refused by name."""
    return ApiError("invalid_request", message, param=param, code="unsupported_parameter")
