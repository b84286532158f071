"""Answers checked against the Open Responses specification (its schemas, vendored in
open_responses_spec/): a `response` object, each streamed event by the schema its `type` names, and a
whole stream read as the specification's compliance suite reads one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Iterable

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).resolve().parent / "open_responses_spec" / "schemas.json"
_URI = "urn:open-responses:2026-04-24"


@cache
def _document() -> dict[str, Any]:
    return dict(json.loads(SPEC.read_text()))


@cache
def _validator(name: str) -> Draft202012Validator:
    registry: Registry[Any] = Registry().with_resource(
        _URI, Resource.from_contents(_document(), default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"{_URI}#/components/schemas/{name}"}, registry=registry)


@cache
def event_schemas() -> dict[str, str]:
    """Each streamed event type → the name of its schema."""
    schemas = _document()["components"]["schemas"]
    return {schema["properties"]["type"]["enum"][0]: name for name, schema in schemas.items()
            if name.endswith("StreamingEvent")}


def problems(instance: Any, schema: str) -> list[str]:
    """Where ``instance`` breaks the named schema of the specification (empty when it conforms)."""
    errors = sorted(_validator(schema).iter_errors(instance), key=lambda error: list(error.absolute_path))
    return [f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message[:300]}" for error in errors]


def check_response(body: Any) -> dict[str, Any]:
    """``body``, asserted to be a `ResponseResource`."""
    found = problems(body, "ResponseResource")
    assert not found, "not a ResponseResource:\n" + "\n".join(found)
    return dict(body)


def check_event(data: Any) -> dict[str, Any]:
    """One streamed event, asserted to conform to the schema of its `type`."""
    kind = data.get("type") if isinstance(data, dict) else None
    assert kind in event_schemas(), f"not an event type of the specification: {kind!r}"
    found = problems(data, event_schemas()[kind])
    assert not found, f"{kind} does not conform:\n" + "\n".join(found)
    return dict(data)


@dataclass
class Stream:
    """A Responses event stream as the compliance suite reads it: every event checked, the final
    response taken from `response.completed`, `response.failed` or `response.incomplete`."""

    events: list[dict[str, Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # each event's `event:` line
    final: dict[str, Any] | None = None

    @property
    def types(self) -> list[str]:
        return [event["type"] for event in self.events]


def read_stream(lines: Iterable[str]) -> Stream:
    """The events of an SSE body's lines (`event:` + `data:`, a blank line ends each), each checked;
    a `[DONE]` line is not an event."""
    stream, name, data = Stream(), "", ""
    for line in [*lines, ""]:
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data = line[len("data:"):].strip()
        elif line == "" and data:
            if data != "[DONE]":
                event = check_event(json.loads(data))
                stream.events.append(event)
                stream.names.append(name or event["type"])
                if event["type"] in ("response.completed", "response.failed", "response.incomplete"):
                    stream.final = event["response"]
            name, data = "", ""
    return stream
