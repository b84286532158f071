"""OpenAI chat-completion chunks, shared by the coordinator's relay and the node's direct mode:
what counts as content, the SSE framing, and assembling a non-streaming answer from chunks."""

from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("refusal") or delta.get("function_call"):
            return True
    return False


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    """Whether a streamed answer ends with the ``choices: []`` usage chunk: only when asked for with
    ``stream_options.include_usage: true``, as OpenAI does (clients indexing ``choices[0]`` on every
    chunk break otherwise)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class MessageBuilder:
    """Merges streamed deltas (content, tool calls, finish reason) into one assistant message."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._merge_tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        merged = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)),
                                            {"id": None, "type": "function",
                                             "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            merged["id"] = call["id"]
        function = call.get("function") or {}
        merged["function"]["name"] += function.get("name") or ""
        merged["function"]["arguments"] += function.get("arguments") or ""

    def choice(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            message["content"] = message["content"] or None
        return {"index": 0, "message": message, "finish_reason": self.finish_reason or "stop",
                "logprobs": None}
