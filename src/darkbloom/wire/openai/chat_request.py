"""The chat-completions request (`POST /v1/chat/completions`, and what the Responses and Messages
APIs become): one schema that checks it — coordinator and direct mode alike — and that the OpenAPI
document shows. It checks what no provider could serve; the rest is the provider's to judge, and
fields it does not name pass through untouched."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, WithJsonSchema, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.openai.body_schema import OPEN, BodySchema, Refusal, described
from darkbloom.wire.openai.parameters import (MODEL_REFUSAL, SAMPLING_REFUSALS, STREAM_REFUSAL, Model, PositiveInt,
                                              Sampling)


@with_config(OPEN)
class TextContentPart(TypedDict):
    type: Literal["text", "input_text"]
    text: str


@with_config(OPEN)
class ContentPart(TypedDict):
    """An image (`image_url`) or any other typed part, for the model to judge."""

    type: Annotated[str, WithJsonSchema({"type": "string", "not": {"enum": ["text", "input_text"]}})]


def _part_kind(part: object) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        return None
    return "text_part" if kind in ("text", "input_text") else "other_part"


Part = Annotated[Union[Annotated[TextContentPart, Tag("text_part")], Annotated[ContentPart, Tag("other_part")]],
                 Discriminator(_part_kind)]


@with_config(OPEN)
class ChatMessage(TypedDict):
    role: Annotated[str, Field(examples=["system", "user", "assistant", "tool"])]
    content: NotRequired[str | list[Part] | None]


@with_config(OPEN)
class ResponseFormat(TypedDict):
    type: Literal["text", "json_object", "json_schema"]


@with_config(OPEN)
class ChatCompletionRequest(Sampling):
    """OpenAI chat completions. Fields not listed pass through to the provider untouched."""

    model: Model
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: NotRequired[bool | None]
    n: NotRequired[Annotated[int, Field(ge=1, le=1, description="Only 1 is supported.")] | None]
    max_tokens: NotRequired[PositiveInt | None]
    max_completion_tokens: NotRequired[PositiveInt | None]
    tools: NotRequired[Annotated[list[Any], described({"type": "array", "items": {"type": "object"}})] | None]
    functions: NotRequired[Annotated[list[Any], described({"type": "array", "items": {"type": "object"}})] | None]
    response_format: NotRequired[ResponseFormat | None]
    stream_options: NotRequired[Annotated[Any, described({
        "type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}},
        "description": "`include_usage: true` ends a stream with a `choices: []` usage chunk."})]]
    stop: NotRequired[Annotated[Any, described({
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})]]
    seed: NotRequired[Annotated[Any, described({"type": ["integer", "null"]})]]
    tool_choice: NotRequired[Any]
    parallel_tool_calls: NotRequired[Annotated[Any, described({"type": ["boolean", "null"]})]]
    function_call: NotRequired[Any]


CHAT_REQUEST = BodySchema(ChatCompletionRequest, {
    "model": MODEL_REFUSAL,
    "stream": STREAM_REFUSAL,
    "messages": "'messages' must be a non-empty array of messages.",
    "messages[*]": "{param} must be an object with a string 'role'.",
    "messages[*].content": "'{param}' must be a string or an array of content parts.",
    "messages[*].content[*]": "'{param}' must be an object with a string 'type'.",
    "messages[*].content[*].text": "'{param}' must be a string.",
    "n": "'n' must be a positive integer.",
    "n/less_than_equal": "Only n=1 is supported: ask for one choice per request.",
    "max_tokens": "'max_tokens' must be a positive integer.",
    "max_completion_tokens": "'max_completion_tokens' must be a positive integer.",
    **SAMPLING_REFUSALS,
    "tools": "'tools' must be an array.",
    "functions": "'functions' must be an array.",
    "response_format": Refusal("'response_format.type' must be 'text', 'json_object' or 'json_schema'."),
})


def checked(body: dict[str, Any]) -> dict[str, Any]:
    """The body as sent, once it holds nothing no provider could serve (else a 400 naming the parameter)."""
    CHAT_REQUEST.validate(body)
    return body
