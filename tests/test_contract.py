"""docs/openapi.json is the generated document, and no change to it lands incompatibly."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest
from contract import DOC
from openapi_spec_validator import validate

from protocols import classify

COMMITTED = Path(__file__).parent.parent / "docs" / "openapi.json"
REGENERATE = "regenerate it: .venv/bin/ninfer openapi -o docs/openapi.json"


def test_the_document_is_valid_openapi_31() -> None:
    validate(DOC)


def test_committed_document_is_current_and_compatible() -> None:
    committed = orjson.loads(COMMITTED.read_bytes())
    breaks = classify(committed, DOC)
    assert not breaks, (
        "the contract changed incompatibly against docs/openapi.json:\n"
        + "\n".join(f"  {b}" for b in breaks)
        + f"\nIf that is intended (a new major version), {REGENERATE}"
    )
    assert committed == DOC, f"docs/openapi.json is stale (the change is compatible); {REGENERATE}"


def _schema(doc: dict[str, Any], name: str) -> dict[str, Any]:
    schema: dict[str, Any] = doc["components"]["schemas"][name]
    return schema


def _changed(edit: Any) -> list[str]:
    new = copy.deepcopy(DOC)
    edit(new)
    return [b.rule for b in classify(DOC, new)]


def test_identical_documents_are_compatible() -> None:
    assert classify(DOC, copy.deepcopy(DOC)) == []


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"]["temperature"].update(maximum=1),
            "an upper limit was lowered",
            id="lowered-limit",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"]["top_k"].update(minimum=1),
            "a lower limit was raised",
            id="raised-minimum",
        ),
        pytest.param(
            lambda d: (
                _schema(d, "GenerateRequest")["properties"].update(beam={"type": "integer"}),
                _schema(d, "GenerateRequest")["required"].append("beam"),
            ),
            "a new required field",
            id="new-required-field",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"]["stream"].update(default=True),
            "a default changed",
            id="changed-default",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"].pop("ignore_eos"),
            "a request field was removed",
            id="removed-field",
        ),
        pytest.param(
            lambda d: _schema(d, "ChatRequest")["properties"].update(
                stop={"type": "array", "items": {"type": "string"}}
            ),
            "a request type was removed",
            id="narrowed-type",
        ),
        pytest.param(
            lambda d: _schema(d, "ChatMessage")["properties"]["role"]["enum"].remove("developer"),
            "an accepted value was removed",
            id="removed-enum-value",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateResponse")["properties"]["finish_reason"]["enum"].append(
                "aborted"
            ),
            "a new enum value in a response",
            id="new-response-enum",
        ),
        pytest.param(
            lambda d: (
                _schema(d, "GenerateResponse")["properties"].pop("seed"),
                _schema(d, "GenerateResponse")["required"].remove("seed"),
            ),
            "a response field was removed",
            id="removed-response-field",
        ),
        pytest.param(
            lambda d: _schema(d, "Usage")["required"].remove("total_tokens"),
            "a response field is no longer always present",
            id="response-field-optional",
        ),
        pytest.param(
            lambda d: d["paths"].pop("/v1/completions"),
            "an operation was removed",
            id="removed-operation",
        ),
        pytest.param(
            lambda d: d["paths"]["/v1/generate"]["post"]["responses"]["200"]["content"][
                "text/event-stream"
            ]["x-stream-events"].update(progress={"type": "object"}),
            "a new stream event old readers do not know",
            id="new-stream-event",
        ),
    ],
)
def test_incompatible_changes_are_named(edit: Any, rule: str) -> None:
    rules = _changed(edit)
    assert any(r.startswith(rule) for r in rules), rules


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"]["temperature"].update(maximum=5),
            id="raised-limit",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateRequest")["properties"].update(
                beam={"type": "integer", "minimum": 1}
            ),
            id="new-optional-field",
        ),
        pytest.param(
            lambda d: _schema(d, "GenerateResponse")["properties"].update(
                cached_tokens={"type": "integer"}
            ),
            id="new-response-field",
        ),
        pytest.param(
            lambda d: _schema(d, "MessagesRequest")["properties"]["temperature"].update(maximum=2),
            id="raised-anthropic-limit",
        ),
        pytest.param(
            lambda d: _schema(d, "ChatMessage")["properties"]["role"]["enum"].append("critic"),
            id="new-accepted-value",
        ),
    ],
)
def test_compatible_changes_pass(edit: Any) -> None:
    assert _changed(edit) == []
