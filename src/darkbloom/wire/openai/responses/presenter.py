"""The Responses API's answer: the node's chat chunks as a `response` object or its event stream
(`event: <type>` + `data: <json>` lines, numbered by `sequence_number`, no `[DONE]`).

Output items follow the chunks: text opens a `message` item with one `output_text` part, each tool
call a `function_call` item; an item is closed (its `.done` events) when the next one opens or the
answer ends. The non-streamed answer runs the same state machine and drops the events, so both
paths produce the same `output`. A `finish_reason` of `length` makes the response `incomplete`
(`incomplete_details.reason: "max_output_tokens"`). A successful stream always ends with
`response.completed`, even for an incomplete response (OpenAI sends `response.incomplete` then):
the openai SDK's `responses.stream()` and openai-agents take the final response only from
`response.completed`, and clients that know `response.incomplete` read `status` as well.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from darkbloom.wire.openai.chunks import delta_text, sse_event
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.presenters import api_id
from darkbloom.wire.openai.responses import echo
from darkbloom.wire.openai.shaping import TokenCounts, with_cost

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# `Response.error.code` is a closed set in OpenAI's schema; anything else is reported as server_error
_RESPONSE_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})


def usage_object(usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
    return with_cost({"input_tokens": usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}, cost_micro_usd)


class ResponsesPresenter:
    media_type = "text/event-stream"

    def __init__(self, request_id: str, model: str, request: dict[str, Any]) -> None:
        self.id = api_id("resp_", request_id)
        self.model = model
        self.request = request
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.call_items: dict[int, dict[str, Any]] = {}  # tool-call index → its function_call item
        self.finish_reason: str | None = None
        self.sequence = 0

    # -- the response object ---------------------------------------------------------------------

    def _response(self, status: str, usage: TokenCounts | None = None, error: dict[str, Any] | None = None,
                  cost_micro_usd: int | None = None) -> dict[str, Any]:
        reason = _INCOMPLETE.get(self.finish_reason or "") if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None, "status": status,
            "model": self.model, "output": [self._public(item) for item in self.output],
            "error": error, "incomplete_details": {"reason": reason} if reason else None,
            **echo.echo(self.request),
            "usage": usage_object(usage, cost_micro_usd) if usage is not None else None,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish_reason in _INCOMPLETE else "completed"

    # -- items -----------------------------------------------------------------------------------

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return sse_event(kind, payload)

    def _open_message(self) -> list[bytes]:
        item = {"type": "message", "id": "msg_" + secrets.token_hex(12), "role": "assistant",
                "status": "in_progress", "content": []}
        events = self._add_item(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=item["_index"],
                                  content_index=0, part=dict(part)))
        item["content"].append(part)
        return events

    def _open_call(self, call: dict[str, Any]) -> list[bytes]:
        function = call.get("function") or {}
        item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12),
                "call_id": call.get("id") or "call_" + secrets.token_hex(12), "name": function.get("name") or "",
                "arguments": "", "status": "in_progress"}
        self.call_items[call.get("index", len(self.call_items))] = item
        return self._add_item(item)

    def _add_item(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        item["_index"] = len(self.output)
        self.output.append(item)
        self.open = item
        return events + [self._event("response.output_item.added", output_index=item["_index"],
                                     item=self._public(item))]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = item["_index"]
        item["status"] = "incomplete" if self._status() == "incomplete" and item["type"] == "message" else "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        return events + [self._event("response.output_item.done", output_index=index, item=self._public(item))]

    @staticmethod
    def _public(item: dict[str, Any]) -> dict[str, Any]:
        public = {key: value for key, value in item.items() if key != "_index"}
        if "content" in public:
            public["content"] = [dict(part) for part in public["content"]]
        return public

    def _take(self, chunk: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta_text(delta)
            if text:
                if self.open is None or self.open["type"] != "message":
                    events += self._open_message()
                item = self.open
                assert item is not None
                item["content"][0]["text"] += text
                events.append(self._event("response.output_text.delta", item_id=item["id"],
                                          output_index=item["_index"], content_index=0, delta=text, logprobs=[]))
            for call in delta.get("tool_calls") or ():
                item = self.call_items.get(call.get("index", len(self.call_items)))
                if item is None:
                    events += self._open_call(call)
                    item = self.open
                    assert item is not None
                fragment = (call.get("function") or {}).get("arguments") or ""
                if fragment:
                    item["arguments"] += fragment
                    events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                              output_index=item["_index"], delta=fragment))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    # -- the Presenter interface -----------------------------------------------------------------

    def stream_start(self) -> list[bytes]:
        created = self._response("in_progress")
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        return self._take(chunk)

    def stream_end(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> list[bytes]:
        events = self._close()
        completed = self._response(self._status(), usage, cost_micro_usd=cost_micro_usd)
        return events + [self._event("response.completed", response=completed)]

    def stream_error(self, error: ApiError) -> list[bytes]:
        """The spec's `error` event (its payload nested in `error`; OpenAI's flat `code`, `message` and
        `param` kept beside it), then `response.failed`."""
        code = error.code if error.code in _RESPONSE_ERROR_CODES else "server_error"
        payload = {"type": error.type, "code": error.code, "message": error.message, "param": error.param}
        return [self._event("error", error=payload, code=error.code, message=error.message, param=error.param),
                self._event("response.failed",
                            response=self._response("failed", error={"code": code, "message": error.message}))]

    def collect(self, chunk: dict[str, Any]) -> None:
        self._take(chunk)

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        self._close()
        return self._response(self._status(), usage, cost_micro_usd=cost_micro_usd)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()
