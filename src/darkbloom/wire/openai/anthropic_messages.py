"""Anthropic's Messages API (`POST /v1/messages`) as a translation to chat completions and back.

`messages_to_chat` turns a Messages request into the chat-completions body a node serves (400 in
Anthropic's terms, naming the param, for what cannot be translated); `MessagesPresenter` answers
from the node's chat chunks in Anthropic's `message` shape, whole or as Anthropic's event stream
(`message_start`, `ping`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`); `anthropic_error_body` is Anthropic's error envelope for any of our errors.

Structured output (`output_config.format`, a JSON schema) becomes chat's `response_format`
`json_schema`, strict. `metadata`, `thinking`, `service_tier`, `output_config.effort` and cache
controls are accepted and not forwarded.

In the answer, text becomes a `text` block, each tool call a `tool_use` block (`input` the parsed
arguments; `{}` when they are not a JSON object). The prompt's token count is known only at the
end: `message_start` says `input_tokens: 0` and `message_delta.usage` carries the real counts. As
Anthropic counts them, `input_tokens` are the prompt tokens the node evaluated and
`cache_read_input_tokens` those it read from its cache (their sum is the chat usage's
`prompt_tokens`); `cache_creation_input_tokens` is always 0 (a node caches without being asked;
nothing is written at a charge of its own). A node's `stop` is `end_turn` (a node does not say
whether a stop sequence ended the text, so `stop_sequence` stays null).
"""

from __future__ import annotations

import json
from typing import Any

from darkbloom.wire.openai.chunks import delta_text, sse_event
from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.wire.openai.parameters import check_model
from darkbloom.wire.openai.presenters import api_id
from darkbloom.wire.openai.shaping import TokenCounts, with_cost

_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # a reasoning model's; a chat model reads none


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    check_model(body)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid_request("max_tokens is required: a positive integer.", param="max_tokens")
    chat = messages_prompt(body)
    chat["max_tokens"] = max_tokens
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid_request("stop_sequences must be an array of strings.", param="stop_sequences")
        if stop:
            chat["stop"] = stop
    for field in ("temperature", "top_p", "top_k", "stream"):
        if body.get(field) is not None:
            chat[field] = body[field]
    return chat


def messages_prompt(body: dict[str, Any]) -> dict[str, Any]:
    """What of a Messages request the model reads, as chat: `model`, `messages` (the system prompt
    first), `tools`, `tool_choice` and `response_format` — the part `count_tokens` counts."""
    model = check_model(body)
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid_request("messages must be a non-empty array of messages.", param="messages")
    for index, message in enumerate(raw):
        messages += _message(message, f"messages[{index}]")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    response_format = _output_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _output_format(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise invalid_request("output_config must be an object.", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid_request("output_config.format must be {type: json_schema, schema: {...}}.",
                              param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in system):
        text = "\n\n".join(block["text"] for block in system)
        return [{"role": "system", "content": text}] if text else []
    raise invalid_request("system must be a string or an array of text blocks.", param="system")


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the rest
    of that user turn), tool uses the assistant's `tool_calls`."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise invalid_request(f"{where}.role must be 'user' or 'assistant'.", param=f"{where}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_request(f"{where}.content must be a string or an array of content blocks.",
                              param=f"{where}.content")
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid_request(f"{at} needs a string id and name.", param=at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid_request(f"{at}.tool_use_id must be a string.", param=f"{at}.tool_use_id")
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                  "content": _tool_result_text(block.get("content"), f"{at}.content")})
        elif kind in _SKIPPED_BLOCKS and role == "assistant":
            continue
        else:
            raise invalid_request(f"{at}: a {json.dumps(kind)} block is not supported in a {role} message.",
                                  param=at)
    out = list(tool_messages)
    if calls:
        text = "".join(part["text"] for part in parts if part["type"] == "text")
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts or not tool_messages:
        texts_only = all(part["type"] == "text" for part in parts)
        out.append({"role": role, "content": "".join(p["text"] for p in parts) if texts_only else parts})
    return out


def _image_url(source: Any, where: str) -> str:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise invalid_request(f"{where}.source must be a base64 or url image source (uploaded files are not "
                          "available).", param=f"{where}.source")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(block["text"] for block in content)
    raise invalid_request(f"{where} must be a string or an array of text blocks.", param=where)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid_request("tools must be an array of tools.", param="tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid_request(f"tools[{index}]: only custom tools (name, description, input_schema) are "
                                  f"supported, not {json.dumps(kind)}.", param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid_request(f"tools[{index}].name must be a non-empty string.", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid_request(f"tools[{index}].input_schema must be a JSON schema object.", param="tools")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    chosen: dict[str, Any]
    if kind == "auto":
        chosen = {"tool_choice": "auto"}
    elif kind == "any":
        chosen = {"tool_choice": "required"}
    elif kind == "none":
        chosen = {"tool_choice": "none"}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chosen = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise invalid_request("tool_choice must be {type: auto|any|none} or {type: tool, name}.", param="tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chosen["parallel_tool_calls"] = False
    return chosen


# -- the answer: chat chunks → Anthropic's `message` or its event stream; the error envelope -------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                 "content_filter": "refusal"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the type mapped from the HTTP status."""
    return {"type": "error", "error": {"type": anthropic_error_type(error.status), "message": error.message}}


def tool_use_id(call_id: str | None) -> str:
    """A node's tool-call id (`call_…`) in Anthropic's style (`toolu_…`)."""
    if not call_id:
        return api_id("toolu_", "")
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def _parsed_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: TokenCounts | None, cost_micro_usd: int | None = None) -> dict[str, Any]:
    """Anthropic's usage object (all 0 before the counts are known): the prompt tokens read from the
    node's cache are `cache_read_input_tokens`, the others `input_tokens`."""
    prompt, cached, output = (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) if usage else (0, 0, 0)
    return with_cost({"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": cached, "output_tokens": output}, cost_micro_usd)


class MessagesPresenter:
    media_type = "text/event-stream"

    def __init__(self, request_id: str, model: str, request: dict[str, Any]) -> None:
        self.id = api_id("msg_", request_id)
        self.model = model
        self.blocks: list[dict[str, Any]] = []  # text blocks, and tool_use blocks with raw `arguments`
        self.open: int | None = None  # index of the block receiving deltas
        self.call_blocks: dict[int, int] = {}  # tool-call index → block index
        self.finish_reason: str | None = None

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.open = len(self.blocks)
        self.blocks.append(block)
        start = ({"type": "text", "text": ""} if block["type"] == "text"
                 else {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}})
        return events + [sse_event("content_block_start", {"type": "content_block_start", "index": self.open,
                                                           "content_block": start})]

    def _close(self) -> list[bytes]:
        index, self.open = self.open, None
        if index is None:
            return []
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.open, "delta": delta})

    def _take(self, chunk: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta_text(delta)
            if text:
                if self.open is None or self.blocks[self.open]["type"] != "text":
                    events += self._open_block({"type": "text", "text": ""})
                assert self.open is not None
                self.blocks[self.open]["text"] += text
                events.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or ():
                key = call.get("index", len(self.call_blocks))
                function = call.get("function") or {}
                if key not in self.call_blocks:
                    events += self._open_block({"type": "tool_use", "id": tool_use_id(call.get("id")),
                                                "name": function.get("name") or "", "arguments": ""})
                    assert self.open is not None
                    self.call_blocks[key] = self.open
                fragment = function.get("arguments") or ""
                if fragment:
                    self.blocks[self.call_blocks[key]]["arguments"] += fragment
                    if self.open == self.call_blocks[key]:
                        events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _stop_reason(self) -> str:
        if self.call_blocks and self.finish_reason in (None, "stop"):
            return "tool_use"  # a forced tool call may end with a plain stop
        return _STOP_REASONS.get(self.finish_reason or "stop", "end_turn")

    def _content(self) -> list[dict[str, Any]]:
        return [block if block["type"] == "text" else
                {"type": "tool_use", "id": block["id"], "name": block["name"],
                 "input": _parsed_input(block["arguments"])} for block in self.blocks]

    def stream_start(self) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}
        return [sse_event("message_start", {"type": "message_start", "message": message}),
                sse_event("ping", {"type": "ping"})]

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        return self._take(chunk)

    def stream_end(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> list[bytes]:
        delta = {"type": "message_delta", "delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
                 "usage": _usage(usage, cost_micro_usd)}
        return self._close() + [sse_event("message_delta", delta), sse_event("message_stop", {"type": "message_stop"})]

    def stream_error(self, error: ApiError) -> list[bytes]:
        return [sse_event("error", anthropic_error_body(error))]

    def collect(self, chunk: dict[str, Any]) -> None:
        self._take(chunk)

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self._content(), "stop_reason": self._stop_reason(), "stop_sequence": None,
                "usage": _usage(usage, cost_micro_usd)}

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return anthropic_error_body(error)
