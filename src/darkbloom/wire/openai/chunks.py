"""OpenAI chat-completion chunks, shared by the coordinator's relay and the node's direct mode:
what counts as content, the SSE framing, and assembling a non-streaming answer from chunks."""

from __future__ import annotations

from typing import Any

from darkbloom.wire import json_codec

SSE_DONE = b"data: [DONE]\n\n"


def has_content(chunk: dict[str, Any]) -> bool:
    """Whether a node chunk carries part of the answer: chat deltas (text, tool calls, a refusal),
    a legacy completion's text, or embedding vectors."""
    if chunk.get("data"):
        return True
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("refusal") or delta.get("function_call"):
            return True
    return False


def delta_text(delta: dict[str, Any]) -> str:
    """The text a chat delta adds to the answer: its content and any refusal (both shown as text by
    the Responses and Messages presenters)."""
    return (delta.get("content") or "") + (delta.get("refusal") or "")


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    """Whether a streamed answer ends with the ``choices: []`` usage chunk: only when asked for with
    ``stream_options.include_usage: true``, as OpenAI does (clients indexing ``choices[0]`` on every
    chunk break otherwise)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json_codec.dumps(data) + b"\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    """A named SSE event (`event: <kind>` then its `data:` line), as the Responses and Messages
    streams send them."""
    return f"event: {kind}\n".encode() + sse(data)


class MessageBuilder:
    """Merges streamed chat deltas into one assistant message as OpenAI returns it: text, a refusal,
    tool calls (by index), a legacy function call, logprobs (``content`` entries in order) and the
    finish reason the node sent."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, str] | None = None
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            if delta.get("refusal"):
                self.refusal.append(delta["refusal"])
            for call in delta.get("tool_calls") or ():
                self._merge_tool_call(call)
            if isinstance(delta.get("function_call"), dict):
                merged = self.function_call or {"name": "", "arguments": ""}
                merged["name"] += delta["function_call"].get("name") or ""
                merged["arguments"] += delta["function_call"].get("arguments") or ""
                self.function_call = merged
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                self.logprobs = (self.logprobs or []) + logprobs["content"]
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

    @property
    def text(self) -> str:
        return "".join(self.content)

    def calls(self) -> list[dict[str, Any]]:
        """The tool calls in index order."""
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]

    def choice(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text,
                                   "refusal": "".join(self.refusal) or None}
        if self.tool_calls:
            message["tool_calls"] = self.calls()
        if self.function_call is not None:
            message["function_call"] = self.function_call
        if (self.tool_calls or self.function_call is not None) and not message["content"]:
            message["content"] = None
        logprobs = None if self.logprobs is None else {"content": self.logprobs, "refusal": None}
        return {"index": 0, "message": message, "finish_reason": self.finish_reason or "stop",
                "logprobs": logprobs}
