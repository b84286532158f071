"""One type per request body that both validates it and documents it: a TypedDict checked by
pydantic (strict: no coercion, a bool is no number) whose JSON Schema the OpenAPI document shows.

A failure is the named 400 `invalid_request_error`, built here and only here: `param` is where the
body went wrong (`messages[0].content`), found by following pydantic's error location through the
body itself, so that the names pydantic gives the members of a union never show. Each schema has a
table of what to say, by path pattern (`messages[*].content`, `n/less_than_equal` for one kind of
error): the nearest entry at or above the failing path is used, and `param` names its path.

Validation only checks; the body a route keeps is the one it read, so fields a schema does not name
pass through untouched (open schemas ignore them, closed ones refuse them with their own 400).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, Mapping, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError, WithJsonSchema
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import ErrorDetails

from darkbloom.wire.openai.errors import ApiError, invalid_request

Body = TypeVar("Body")
Step = str | int

# unknown fields pass through to the node (not copied: the body read is the one sent)
OPEN = ConfigDict(extra="ignore", strict=True, json_schema_extra={"additionalProperties": True})
# unknown fields are refused (the management routes: a typo must not be silently ignored)
CLOSED = ConfigDict(extra="forbid", strict=True)


def described(schema: dict[str, Any]) -> WithJsonSchema:
    """For a field typed `Any`: what the document says of a value checked further on (by the node),
    not here."""
    return WithJsonSchema(schema)


@dataclass(frozen=True)
class Refusal:
    """What a 400 says: `message` and `param` are templates of `{param}` (the path of the entry's
    pattern); `message` also of the error's context (`{max_length}`, `{actual_length}`, …) and, for
    unknown fields, of `{names}` and `{known}`."""

    message: str
    param: str = "{param}"
    code: str | None = None


Refusals = Mapping[str, "str | Refusal"]


class BodySchema(Generic[Body]):
    def __init__(self, body: type[Body], refusals: Refusals | None = None, *,
                 unknown: str | None = None) -> None:
        self.name = body.__name__
        self._adapter: TypeAdapter[Body] = TypeAdapter(body)
        self._refusals = dict(refusals or {})
        self._unknown = unknown  # the message for unknown fields of a closed schema
        self.fields = tuple(body.__annotations__)

    def validate(self, body: object) -> Body:
        try:
            return self._adapter.validate_python(body)
        except ValidationError as error:
            raise self._refusal(error.errors(include_url=False), body) from None

    def json_schemas(self) -> dict[str, dict[str, Any]]:
        """Its JSON Schema under its name, and every schema it refers to under theirs, for an OpenAPI
        document's `components/schemas`."""
        schema = self._adapter.json_schema(ref_template="#/components/schemas/{model}",
                                           schema_generator=_Untitled)
        return {**schema.pop("$defs", {}), self.name: schema}

    def _refusal(self, errors: list[ErrorDetails], body: object) -> ApiError:
        unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
        if unknown and self._unknown is not None:
            names = ", ".join(f"'{name[:64]}'" for name in unknown[:5]) + (", …" if len(unknown) > 5 else "")
            return invalid_request(self._unknown.format(names=names, known=", ".join(self.fields)),
                                   param=unknown[0][:64])
        steps, error = _meant(errors, body)
        for cut in range(len(steps), -1, -1):  # the failing path, then each path above it
            if cut < len(steps) and steps[cut][0] is _TAG:
                continue
            above = steps[:cut]
            tagged, plain = _pattern(above + _tags_after(steps, cut)), _pattern(above, tags=False)
            keys = (f"{tagged}/{error['type']}", tagged, f"{plain}/{error['type']}", plain)
            told = next((self._refusals[key] for key in keys if key in self._refusals), None)
            if told is not None:
                refusal = told if isinstance(told, Refusal) else Refusal(told)
                at = _param(_path(above))
                message = refusal.message.format(**{**error.get("ctx", {}), "param": at})
                return ApiError(400, "invalid_request_error", message, code=refusal.code,
                                param=refusal.param.format(param=at) or None)
        at = _param(_path(steps))
        if error["type"] == "missing":
            return invalid_request(f"'{at}' is required.", param=at)
        return invalid_request(f"'{at}': {error['msg']}." if at else f"The request body: {error['msg']}.",
                               param=at or None)


class _Untitled(GenerateJsonSchema):
    """No `title` on every property: the document names what matters."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


_KEY = "key"   # a field's name or an index in an error's location
_TAG = "tag"   # a union member's name there
_NAMED = re.compile(r"[a-z_]+")  # a member's own ``Tag`` (pydantic's names are like `list[str]`)
Located = tuple[tuple[str, Step], ...]


def _meant(errors: list[ErrorDetails], body: object) -> tuple[Located, ErrorDetails]:
    """The first error, or, when a union field failed, the error of the member that got furthest
    into the value (the member the caller meant)."""
    steps, error = _located(errors[0], body), errors[0]
    first = _path(steps)
    for other in errors[1:]:
        where = _located(other, body)
        if len(_path(where)) > len(_path(steps)) and _path(where)[:len(first)] == first:
            steps, error = where, other
    return steps, error


def _located(error: ErrorDetails, body: object) -> Located:
    """The error's location followed through ``body``: a step the value at hand has is a key or an
    index; one it lacks is a union member's name (a tag), unless it is the last (a missing field)."""
    loc = error["loc"]
    value: object = body
    steps: list[tuple[str, Step]] = []
    for index, step in enumerate(loc):
        if isinstance(step, int) and isinstance(value, list) and 0 <= step < len(value):
            value = value[step]
            steps.append((_KEY, step))
        elif isinstance(step, str) and isinstance(value, dict) and step in value:
            value = value[step]
            steps.append((_KEY, step))
        elif index == len(loc) - 1 and isinstance(step, str) and error["type"] in ("missing", "extra_forbidden"):
            steps.append((_KEY, step))
        else:
            steps.append((_TAG, step))
    return tuple(steps)


def _path(steps: Located) -> tuple[Step, ...]:
    return tuple(step for kind, step in steps if kind is not _TAG)


def _tags_after(steps: Located, cut: int) -> Located:
    """The tags naming which member the value at ``cut`` is: those before the next key or index."""
    tags = []
    for kind, step in steps[cut:]:
        if kind is not _TAG:
            break
        tags.append((kind, step))
    return tuple(tags)


def _pattern(steps: Located, tags: bool = True) -> str:
    """`input[*]@function_call.name`: indices as `[*]`, a member's ``Tag`` name as `@name` (when
    ``tags``)."""
    text = ""
    for kind, step in steps:
        if kind is _TAG:
            text += f"@{step}" if tags and _NAMED.fullmatch(str(step)) else ""
        elif isinstance(step, int):
            text += "[*]"
        else:
            text += f".{step}" if text else step
    return text


def _param(path: tuple[Step, ...]) -> str:
    text = ""
    for step in path:
        if isinstance(step, int):
            text += f"[{step}]"
        else:
            text += f".{step}" if text else step
    return text
