"""One type per body: its failures as the named 400 (`param` from the path through the body, the
names of union members never shown), unknown fields refused by name, and its JSON Schema."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import pytest
from pydantic import Discriminator, Field, Tag, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.openai.body_schema import CLOSED, OPEN, BodySchema, Refusal
from darkbloom.wire.openai.errors import ApiError


@with_config(OPEN)
class Call(TypedDict):
    type: Literal["call"]
    name: str


@with_config(OPEN)
class Note(TypedDict):
    type: Literal["note"]
    text: str


def _kind(item: object) -> str | None:
    kind = item.get("type") if isinstance(item, dict) else None
    return kind if kind in ("call", "note") else None


@with_config(OPEN)
class Body(TypedDict):
    """A test body."""

    count: NotRequired[Annotated[int, Field(ge=1, le=3)] | None]
    content: NotRequired[str | list[Annotated[Union[Annotated[Call, Tag("call")], Annotated[Note, Tag("note")]],
                                              Discriminator(_kind)]]]
    tags: NotRequired[Annotated[list[str], Field(max_length=2)]]


BODY = BodySchema(Body, {
    "count": "'count' must be a small positive integer.",
    "count/less_than_equal": Refusal("At most {le} please.", code="too_many"),
    "content": "'{param}' must be a string or an array of items.",
    "content[*]@call": "'{param}' must have a string name.",
    "tags[*]": Refusal("'{param}' must be a string.", param="tags"),
})


def refused(body: dict[str, Any], schema: BodySchema[Any] = BODY) -> ApiError:
    with pytest.raises(ApiError) as caught:
        schema.validate(body)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize("body, param, message", [
    ({"count": 0}, "count", "'count' must be a small positive integer."),
    ({"count": True}, "count", "'count' must be a small positive integer."),  # strict: a bool is no number
    ({"content": 5}, "content", "'content' must be a string or an array of items."),
    ({"content": [{"type": "note", "text": 1}]}, "content", "'content' must be a string or an array of items."),
    ({"content": [{"type": "call"}]}, "content[0]", "'content[0]' must have a string name."),
    ({"content": [{"type": "other"}]}, "content", "'content' must be a string or an array of items."),
    ({"extra": 1, "tags": [1, 2, 3]}, "tags", "'tags': List should have at most 2 items after validation, not 3."),
    ({"tags": ["a", 1]}, "tags", "'tags[1]' must be a string."),
])
def test_a_failure_names_its_path_and_says_what_its_table_says(body: dict[str, Any], param: str,
                                                                message: str) -> None:
    error = refused(body)
    assert (error.param, error.message, error.code) == (param, message, "invalid_request_error")


def test_an_entry_for_one_kind_of_error_with_its_own_code_and_context() -> None:
    error = refused({"count": 4})
    assert (error.param, error.message, error.code) == ("count", "At most 3 please.", "too_many")


def test_open_bodies_keep_unknown_fields_and_closed_ones_refuse_them_by_name() -> None:
    body = {"count": 2, "vendor": {"x": 1}}
    BODY.validate(body)
    assert body == {"count": 2, "vendor": {"x": 1}}

    @with_config(CLOSED)
    class Strict(TypedDict, total=False):
        a: int
        b: int

    schema = BodySchema(Strict, unknown="Unknown field(s): {names}. It takes {known}.")
    error = refused({"a": 1, "zz": 2, "yy": 3}, schema)
    assert error.param == "zz" and error.message == "Unknown field(s): 'zz', 'yy'. It takes a, b."


def test_the_json_schema_is_the_validating_type() -> None:
    schemas = BODY.json_schemas()
    assert set(schemas) == {"Body", "Call", "Note"}
    assert schemas["Body"]["additionalProperties"] is True and schemas["Body"]["description"] == "A test body."
    assert schemas["Body"]["properties"]["count"] == {"anyOf": [{"maximum": 3, "minimum": 1, "type": "integer"},
                                                                {"type": "null"}]}
