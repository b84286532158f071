"""OpenAI's Responses API (`POST /v1/responses`), stateless: a Responses request as the
chat-completions body a node serves (the answer's way back is `responses.presenter`).

Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background` and stored
prompts are refused (400 naming the param). Its schema, `ResponseRequest`, checks what is read and
what the response only repeats (`metadata`, `service_tier`, `safety_identifier`, …: rendered by
`echo`, not forwarded); `include` and `reasoning` are accepted and ignored. The sampling numbers are always sent, the node's defaults
filling the ones left out, so that the response reports what the node sampled with.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import Discriminator, Field, Tag, WithJsonSchema, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.openai.body_schema import OPEN, BodySchema, Refusal
from darkbloom.wire.openai.errors import invalid_request
from darkbloom.wire.openai.parameters import (MODEL_REFUSAL, SAMPLING_REFUSALS, STREAM_REFUSAL, Model, PositiveInt,
                                              Sampling, chat_sampling)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_MAX_IDENTIFIER = 64  # safety_identifier, prompt_cache_key, and a metadata key
_MAX_METADATA_PAIRS = 16
_MAX_METADATA_VALUE = 512
_STORED = "Stored responses are not available: '{param}' needs them. Send the whole conversation in 'input' instead."


def _member(tags: Mapping[str, str], unknown: str | None = None) -> Discriminator:
    """A union picked by an object's ``type`` (a message item's may be left out): ``tags`` maps each
    type to its member, any other type goes to ``unknown`` (a member that refuses it by name), and
    anything but an object to none (the 400 of the union's own path)."""
    def tag(value: object) -> str | None:
        if not isinstance(value, dict):
            return None
        kind = value.get("type", "message" if "role" in value else None)
        return tags.get(kind, unknown) if isinstance(kind, str) else unknown
    return Discriminator(tag)


def _refused(description: str) -> WithJsonSchema:
    """A union member that only exists to refuse: the document says no value is one."""
    return WithJsonSchema({"not": {}, "description": description})


@with_config(OPEN)
class InputText(TypedDict):
    type: Literal["input_text", "output_text", "text"]
    text: str


@with_config(OPEN)
class InputRefusal(TypedDict):
    type: Literal["refusal"]


@with_config(OPEN)
class InputImage(TypedDict):
    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1, description="A URL or data URL (uploaded files are not available).")]
    detail: NotRequired[str | None]


InputPart = Annotated[Union[Annotated[InputText, Tag("text")], Annotated[InputRefusal, Tag("refusal")],
                            Annotated[InputImage, Tag("input_image")]],
                      _member({"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
                               "input_image": "input_image"})]


@with_config(OPEN)
class MessageItem(TypedDict):
    type: NotRequired[Literal["message"]]
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


@with_config(OPEN)
class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: NotRequired[str]


@with_config(OPEN)
class OutputTextPart(TypedDict):
    text: str


@with_config(OPEN)
class FunctionCallOutputItem(TypedDict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputTextPart]


@with_config(OPEN)
class ReasoningItem(TypedDict):
    """A reasoning model's summary: accepted, and nothing a chat model reads."""

    type: Literal["reasoning"]


@with_config(OPEN)
class UnsupportedItem(TypedDict):
    type: Literal["message", "function_call", "function_call_output", "reasoning"]


_ITEMS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")],
    Annotated[None, Tag("item_reference"), _refused("item_reference: stored items are not available.")],
    Annotated[UnsupportedItem, Tag("other"), _refused("Any other item type is refused.")],
], _member({kind: kind for kind in _ITEMS}, unknown="other")]


@with_config(OPEN)
class FunctionSpec(TypedDict):
    name: Annotated[str, Field(min_length=1)]


@with_config(OPEN)
class FunctionTool(TypedDict):
    """A function tool, flat (`name`, `description`, `parameters`, `strict`) or in the chat shape."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


@with_config(OPEN)
class ChatShapedTool(TypedDict):
    type: Literal["function"]
    function: FunctionSpec


def _tool_shape(tool: object) -> str | None:
    return None if not isinstance(tool, dict) else "chat" if isinstance(tool.get("function"), dict) else "flat"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("flat")], Annotated[ChatShapedTool, Tag("chat")]],
                 Discriminator(_tool_shape)]


@with_config(OPEN)
class NamedFunction(TypedDict):
    type: Literal["function"]
    name: str


@with_config(OPEN)
class PlainFormat(TypedDict):
    type: Literal["text", "json_object"]


@with_config(OPEN)
class JsonSchemaFormat(TypedDict):
    type: Literal["json_schema"]
    name: str
    schema: dict[str, Any]


TextFormat = Annotated[Union[Annotated[PlainFormat, Tag("plain")], Annotated[JsonSchemaFormat, Tag("json_schema")]],
                       _member({"text": "plain", "json_object": "plain", "json_schema": "json_schema"})]


@with_config(OPEN)
class TextOptions(TypedDict):
    format: NotRequired[TextFormat | None]


Identifier = Annotated[str, Field(max_length=_MAX_IDENTIFIER)]


@with_config(OPEN)
class ResponseRequest(Sampling):
    """OpenAI Responses API, stateless: nothing is stored, so `store: true`, `background: true`,
    `previous_response_id`, `conversation` and stored `prompt`s are refused with 400."""

    model: Model
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: NotRequired[str | None]
    tools: NotRequired[list[Tool] | None]
    tool_choice: NotRequired[Literal["auto", "none", "required"] | NamedFunction | None]
    parallel_tool_calls: NotRequired[bool | None]
    text: NotRequired[TextOptions | None]
    max_output_tokens: NotRequired[PositiveInt | None]
    stream: NotRequired[bool | None]
    store: NotRequired[Literal[False] | None]
    background: NotRequired[Literal[False] | None]
    previous_response_id: NotRequired[None]
    conversation: NotRequired[None]
    prompt: NotRequired[None]
    service_tier: NotRequired[Literal["auto", "default", "flex", "priority"] | None]
    truncation: NotRequired[Literal["auto", "disabled"] | None]
    safety_identifier: NotRequired[Identifier | None]
    prompt_cache_key: NotRequired[Identifier | None]
    max_tool_calls: NotRequired[PositiveInt | None]
    top_logprobs: NotRequired[Annotated[int, Field(ge=0, le=20)] | None]
    metadata: NotRequired[Annotated[dict[Identifier, Annotated[str, Field(max_length=_MAX_METADATA_VALUE)]],
                                    Field(max_length=_MAX_METADATA_PAIRS)] | None]


_PARTS = "'{param}' must be an input_text, output_text or input_image part."
RESPONSE_REQUEST = BodySchema(ResponseRequest, {
    "model": MODEL_REFUSAL,
    "stream": STREAM_REFUSAL,
    **SAMPLING_REFUSALS,
    "input": "'input' must be a string or a non-empty array of input items.",
    "input[*]": "'{param}' must be an object.",
    "input[*]/none_required": _STORED,
    "input[*].type": "'{param}' is not supported: use message, function_call or function_call_output items.",
    "input[*].role": "'{param}' must be one of user, assistant, system or developer.",
    "input[*].content": "'{param}' must be a string or an array of content parts.",
    "input[*].content[*]": _PARTS,
    "input[*].content[*].type": _PARTS,
    "input[*].content[*].text": "'{param}' must be a string.",
    "input[*].content[*].image_url": "'{param}' must be a URL or data URL: uploaded files are not available.",
    "input[*]@function_call": "'{param}' must have string 'call_id', 'name' and 'arguments'.",
    "input[*].call_id": "'{param}' must be a string.",
    "input[*].output": "'{param}' must be a string or an array of input_text parts.",
    "instructions": "'instructions' must be a string.",
    "tools": "'tools' must be an array of function tools.",
    "tools[*]": Refusal("{param}: only function tools are supported here (hosted tools such as web_search are "
                        "not available).", param="tools"),
    "tools[*].name": Refusal("{param} must be a non-empty string.", param="tools"),
    "tools[*].function": Refusal("{param}.name must be a non-empty string.", param="tools"),
    "tool_choice": "'tool_choice' must be 'auto', 'none', 'required' or {{\"type\": \"function\", \"name\": …}}.",
    "parallel_tool_calls": "'parallel_tool_calls' must be a boolean.",
    "text": "'text' must be an object.",
    "text.format": "'text.format' must be of type text, json_object or json_schema (json_schema with a string "
                   "'name' and an object 'schema').",
    "max_output_tokens": "'max_output_tokens' must be a positive integer.",
    "store": "Stored responses are not available: 'store' must be false or left out. Send the whole "
             "conversation in 'input' instead.",
    "background": "Background responses are not available: 'background' must be false or left out.",
    "previous_response_id": _STORED,
    "conversation": _STORED,
    "prompt": _STORED,
    "service_tier": "'service_tier' must be one of auto, default, flex, priority.",
    "truncation": "'truncation' must be one of auto, disabled.",
    "safety_identifier": f"'safety_identifier' must be a string of at most {_MAX_IDENTIFIER} characters.",
    "prompt_cache_key": f"'prompt_cache_key' must be a string of at most {_MAX_IDENTIFIER} characters.",
    "max_tool_calls": "'max_tool_calls' must be an integer of at least 1.",
    "top_logprobs": "'top_logprobs' must be an integer from 0 to 20.",
    "metadata": f"'metadata' must be an object of at most {_MAX_METADATA_PAIRS} string values (keys of at most "
                f"{_MAX_IDENTIFIER} characters, values of at most {_MAX_METADATA_VALUE}).",
})


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body for a Responses request (400 naming the param for what cannot be
    translated); the chat validation then checks it like any chat request."""
    RESPONSE_REQUEST.validate(body)
    chat: dict[str, Any] = {"model": body["model"].strip(), "messages": _messages(body), **chat_sampling(body)}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    return chat


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        for item in items:
            _add_item(messages, item)
    if not messages:
        raise invalid_request("'input' holds no message to answer.", param="input")
    return messages


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": _ROLES[item["role"]], "content": _content(item["content"])})
    elif kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item["output"]
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else "".join(part["text"] for part in output)})


def _content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content as chat content: one text stays a string, images become `image_url` parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == "input_image":
            image = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:
            text = part["text"] if part["type"] != "refusal" else str(part.get("refusal") or "")
            parts.append({"type": "text", "text": text})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool  # the chat shape, leniently
        function = {"name": spec["name"]}
        for field in ("description", "parameters", "strict"):
            if spec.get(field) is not None:
                function[field] = spec[field]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = text.get("format") if text is not None else None
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": schema}
