"""Anthropic's Messages API (`POST /v1/messages`), the request: its schema (`MessageRequest`; the
part the model reads, `MessagePrompt`, is what `count_tokens` takes) and the chat-completions body
it becomes (the answer's way back is `anthropic_messages`). 400s are in Anthropic's terms and name
the param.

Structured output (`output_config.format`, a JSON schema) becomes chat's `response_format`
`json_schema`, strict. `metadata`, `thinking`, `service_tier`, `output_config.effort` and cache
controls are accepted and not forwarded; thinking blocks of earlier turns are dropped (a chat model
reads none).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import Discriminator, Field, Tag, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.openai.body_schema import OPEN, BodySchema, Refusal, Refusals, described
from darkbloom.wire.openai.parameters import MODEL_REFUSAL, SAMPLING_REFUSALS, STREAM_REFUSAL, Model, PositiveInt


def _by_type(tags: Mapping[str, str]) -> Discriminator:
    """A union picked by an object's ``type``; none (the 400 of the union's own path) for another."""
    def tag(value: object) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else None
        return tags.get(kind) if isinstance(kind, str) else None
    return Discriminator(tag)


@with_config(OPEN)
class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


@with_config(OPEN)
class Base64Source(TypedDict):
    type: Literal["base64"]
    media_type: str
    data: str


@with_config(OPEN)
class UrlSource(TypedDict):
    type: Literal["url"]
    url: str


@with_config(OPEN)
class ImageBlock(TypedDict):
    type: Literal["image"]
    source: Annotated[Union[Annotated[Base64Source, Tag("base64")], Annotated[UrlSource, Tag("url")]],
                      _by_type({"base64": "base64", "url": "url"})]


@with_config(OPEN)
class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: NotRequired[str | list[TextBlock] | None]


@with_config(OPEN)
class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str


@with_config(OPEN)
class ThinkingBlock(TypedDict):
    """A reasoning model's: accepted, and nothing a chat model reads."""

    type: Literal["thinking", "redacted_thinking"]


UserBlock = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ImageBlock, Tag("image")],
                            Annotated[ToolResultBlock, Tag("tool_result")]],
                      _by_type({"text": "text", "image": "image", "tool_result": "tool_result"})]
AssistantBlock = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                                 Annotated[ThinkingBlock, Tag("thinking")]],
                           _by_type({"text": "text", "tool_use": "tool_use", "thinking": "thinking",
                                     "redacted_thinking": "thinking"})]


@with_config(OPEN)
class UserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[UserBlock]


@with_config(OPEN)
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


def _role(message: object) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return role if role in ("user", "assistant") else None


@with_config(OPEN)
class CustomTool(TypedDict):
    type: NotRequired[Literal["custom"] | None]
    name: Annotated[str, Field(min_length=1)]
    input_schema: dict[str, Any]
    description: NotRequired[Annotated[Any, described({"type": "string"})]]


@with_config(OPEN)
class ToolChoice(TypedDict):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: NotRequired[Annotated[Any, described({"type": "boolean"})]]


@with_config(OPEN)
class NamedToolChoice(TypedDict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: NotRequired[Annotated[Any, described({"type": "boolean"})]]


@with_config(OPEN)
class OutputFormat(TypedDict):
    type: Literal["json_schema"]
    schema: dict[str, Any]


@with_config(OPEN)
class OutputConfig(TypedDict):
    format: NotRequired[OutputFormat | None]


@with_config(OPEN)
class MessagePrompt(TypedDict):
    """What of an Anthropic Messages request the model reads (all that `count_tokens` needs)."""

    model: Model
    system: NotRequired[str | list[TextBlock] | None]
    messages: Annotated[list[Annotated[Union[Annotated[UserMessage, Tag("user")],
                                             Annotated[AssistantMessage, Tag("assistant")]], Discriminator(_role)]],
                        Field(min_length=1)]
    tools: NotRequired[list[CustomTool] | None]
    tool_choice: NotRequired[Annotated[Union[Annotated[ToolChoice, Tag("plain")],
                                             Annotated[NamedToolChoice, Tag("tool")]],
                                       _by_type({"auto": "plain", "any": "plain", "none": "plain", "tool": "tool"})]
                             | None]
    output_config: NotRequired[OutputConfig | None]


@with_config(OPEN)
class MessageRequest(MessagePrompt):
    """Anthropic Messages. `metadata`, `thinking`, `service_tier`, `output_config.effort` and cache
    controls are accepted and not forwarded."""

    max_tokens: PositiveInt
    stop_sequences: NotRequired[list[str] | None]
    temperature: NotRequired[Annotated[float, Field(ge=0, le=2)] | None]
    top_p: NotRequired[Annotated[float, Field(ge=0, le=1)] | None]
    top_k: NotRequired[Any]
    stream: NotRequired[bool | None]


_BLOCKS = "{param}: a user message holds text, image and tool_result blocks, an assistant message text, tool_use " \
          "and thinking blocks (each with its fields)."
_PROMPT_REFUSALS: Refusals = {
    "model": MODEL_REFUSAL,
    "system": "system must be a string or an array of text blocks.",
    "messages": "messages must be a non-empty array of messages.",
    "messages[*]": Refusal("{param}.role must be 'user' or 'assistant'.", param="{param}.role"),
    "messages[*].role": "{param} must be 'user' or 'assistant'.",
    "messages[*].content": "{param} must be a string or an array of content blocks.",
    "messages[*].content[*]": _BLOCKS,
    "messages[*].content[*]@tool_use": "{param} needs a string id and name.",
    "messages[*].content[*].source": "{param} must be a base64 or url image source (uploaded files are not "
                                     "available).",
    "messages[*].content[*].tool_use_id": "{param} must be a string.",
    "messages[*].content[*].content": "{param} must be a string or an array of text blocks.",
    "tools": "tools must be an array of tools.",
    "tools[*]": Refusal("{param}: only custom tools (name, description, input_schema) are supported.",
                        param="tools"),
    "tools[*].name": Refusal("{param} must be a non-empty string.", param="tools"),
    "tools[*].input_schema": Refusal("{param} must be a JSON schema object.", param="tools"),
    "tool_choice": "tool_choice must be {{type: auto|any|none}} or {{type: tool, name}}.",
    "output_config": "output_config must be an object.",
    "output_config.format": "output_config.format must be {{type: json_schema, schema: {{...}}}}.",
}
MESSAGE_PROMPT = BodySchema(MessagePrompt, _PROMPT_REFUSALS)
MESSAGE_REQUEST = BodySchema(MessageRequest, {
    **_PROMPT_REFUSALS,
    "max_tokens": "max_tokens is required: a positive integer.",
    "stop_sequences": "stop_sequences must be an array of strings.",
    "temperature": SAMPLING_REFUSALS["temperature"],
    "top_p": SAMPLING_REFUSALS["top_p"],
    "stream": STREAM_REFUSAL,
})


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    MESSAGE_REQUEST.validate(body)
    chat = _prompt(body)
    chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for field in ("temperature", "top_p", "top_k", "stream"):
        if body.get(field) is not None:
            chat[field] = body[field]
    return chat


def messages_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """What of a Messages request the model reads, as chat: `model`, `messages` (the system prompt
    first), `tools`, `tool_choice` and `response_format` — the part `count_tokens` counts."""
    MESSAGE_PROMPT.validate(body)
    return _prompt(body)


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    messages = _system(body.get("system"))
    for message in body["messages"]:
        messages += _message(message)
    chat: dict[str, Any] = {"model": body["model"].strip(), "messages": messages}
    if body.get("tools") is not None:
        chat["tools"] = [_tool(tool) for tool in body["tools"]]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    return chat


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "\n\n".join(block["text"] for block in system)
    return [{"role": "system", "content": text}] if text else []


def _message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the rest
    of that user turn), tool uses the assistant's `tool_calls`."""
    role, content = message["role"], message["content"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                  "content": _tool_result_text(block.get("content"))})
    out = list(tool_messages)
    if calls:
        text = "".join(part["text"] for part in parts if part["type"] == "text")
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts or not tool_messages:
        texts_only = all(part["type"] == "text" for part in parts)
        out.append({"role": role, "content": "".join(p["text"] for p in parts) if texts_only else parts})
    return out


def _image_url(source: dict[str, Any]) -> str:
    if source["type"] == "base64":
        return f"data:{source['media_type']};base64,{source['data']}"
    return str(source["url"])


def _tool_result_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block["text"] for block in content)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice["type"]
    chosen: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind) or
                              {"type": "function", "function": {"name": choice["name"]}}}
    if choice.get("disable_parallel_tool_use") is True:
        chosen["parallel_tool_calls"] = False
    return chosen
