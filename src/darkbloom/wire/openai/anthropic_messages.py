"""Anthropic's Messages API (`POST /v1/messages`), the answer: `MessagesPresenter` answers from the
node's chat chunks in Anthropic's `message` shape, whole or as Anthropic's event stream
(`message_start`, `ping`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`); `anthropic_error_body` is Anthropic's error envelope for any of our errors (the
request's way in is `anthropic_request`).

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
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.presenters import api_id
from darkbloom.wire.openai.shaping import TokenCounts, with_cost

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
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
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
