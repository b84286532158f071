"""One presenter per API: a node's chunks in the shape the caller's API answers with, streamed or not.

The coordinator and direct mode drive them alike (one instance per request): `stream_start` just
before the first chunk goes out, `stream_chunk` for each node chunk (never the usage chunk),
then `stream_end` or `stream_error`; a non-streamed answer is `collect` per chunk, then `response`.
`stream_end` and `response` take the request's cost when the caller gets one (the coordinator's
settlement; `shaping.with_cost`) and put it in that API's usage object as `cost_micro_usd`.
This module holds the OpenAI ones (chat, legacy completions, embeddings); the Responses API and
Anthropic Messages live in `responses/` and `anthropic_messages`.
"""

from __future__ import annotations

import base64
import secrets
import sys
from array import array
from typing import Any, Protocol

from darkbloom.wire.openai.chunks import SSE_DONE, MessageBuilder, sse, wants_usage_chunk
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.openai.shaping import ChunkShaper, TokenCounts, usage_dict, with_cost


class Presenter(Protocol):
    """One answer in one API's shape, built from node chunks. One instance per request:
    `Presenter(request_id, model, request)` — `model` is the id the caller asked for, `request` the
    caller's own (untranslated) body."""

    media_type: str

    def stream_start(self) -> list[bytes]: ...

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def stream_end(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> list[bytes]: ...

    def stream_error(self, error: ApiError) -> list[bytes]: ...

    def collect(self, chunk: dict[str, Any]) -> None: ...

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]: ...

    def error_body(self, error: ApiError) -> dict[str, Any]: ...


def api_id(prefix: str, request_id: str) -> str:
    """The answer's id in its API's style (`resp_…`, `msg_…`) for our request id: the id itself
    when it already has the prefix, else the prefix on its random part (`chatcmpl-ab12` → `resp_ab12`)."""
    if request_id.startswith(prefix):
        return request_id
    tail = request_id.split("-", 1)[1] if "-" in request_id else request_id
    return prefix + (tail or secrets.token_hex(12))


class _OpenAIStream:
    """The streaming rules chat and legacy completions share: one `data:` line per shaped chunk, the
    `choices: []` usage chunk only on `stream_options.include_usage`, one `data: [DONE]`; an in-band
    failure is one `data: {"error": …}` event and no `[DONE]`."""

    media_type = "text/event-stream"

    def __init__(self, shaper: ChunkShaper, request: dict[str, Any]) -> None:
        self.shaper = shaper
        self.include_usage = wants_usage_chunk(request)

    def stream_start(self) -> list[bytes]:
        return []

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        return [sse(self.shaper.chunk(chunk))]

    def stream_end(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> list[bytes]:
        if not self.include_usage:
            return [SSE_DONE]
        return [sse(self.shaper.usage_chunk(usage, cost_micro_usd)), SSE_DONE]

    def stream_error(self, error: ApiError) -> list[bytes]:
        return [sse(error.body())]

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()


class ChatPresenter(_OpenAIStream):
    """`chat.completion` and its chunks: our id and model on every chunk, `content` beside the
    opening `role`, the `choices: []` usage
    chunk only on `stream_options.include_usage`, one `data: [DONE]`; an in-band failure is one
    `data: {"error": …}` event and no `[DONE]`."""

    def __init__(self, request_id: str, model: str, request: dict[str, Any]) -> None:
        super().__init__(ChunkShaper(request_id, model), request)
        self.message = MessageBuilder()

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        for choice in chunk.get("choices") or ():
            _with_content(choice.get("delta"))
        return super().stream_chunk(chunk)

    def collect(self, chunk: dict[str, Any]) -> None:
        self.message.add(chunk)

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        return self.shaper.completion(self.message, usage, cost_micro_usd)


def _with_content(delta: Any) -> None:
    """A delta opening the message (`role`) carries `content` as OpenAI's does: `""`, or null beside
    tool calls; clients read it from the first chunk on."""
    if isinstance(delta, dict) and "role" in delta and "content" not in delta:
        delta["content"] = None if delta.get("tool_calls") or delta.get("function_call") else ""


class CompletionsPresenter(_OpenAIStream):
    """Legacy `text_completion` objects, streamed (same SSE rules as chat; a batch's chunks carry each
    prompt's `index`) or whole: one choice per prompt, in order, its text joined and its legacy logprobs
    lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) concatenated."""

    def __init__(self, request_id: str, model: str, request: dict[str, Any]) -> None:
        super().__init__(ChunkShaper(api_id("cmpl-", request_id), model, "text_completion"), request)
        self.choices = [_CompletionChoice() for _ in completion_prompts(request)]

    def collect(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if isinstance(index, int) and 0 <= index < len(self.choices):
                self.choices[index].add(choice)

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        return {"id": self.shaper.request_id, "object": "text_completion", "created": self.shaper.created,
                "model": self.shaper.model, "choices": [c.whole(i) for i, c in enumerate(self.choices)],
                "usage": usage_dict(usage, cost_micro_usd)}


class _CompletionChoice:
    _LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: dict[str, list[Any]] | None = None
        self.finish_reason: str | None = None

    def add(self, choice: dict[str, Any]) -> None:
        if isinstance(choice.get("text"), str):
            self.text.append(choice["text"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            merged = self.logprobs if self.logprobs is not None else {k: [] for k in self._LOGPROB_LISTS}
            for key in self._LOGPROB_LISTS:
                merged[key].extend(logprobs.get(key) or ())
            self.logprobs = merged
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def whole(self, index: int) -> dict[str, Any]:
        return {"index": index, "text": "".join(self.text), "logprobs": self.logprobs,
                "finish_reason": self.finish_reason or "stop"}


def float32_base64(vector: list[float]) -> str:
    """An embedding as OpenAI's `encoding_format: "base64"` sends it: little-endian float32, base64."""
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


class EmbeddingsPresenter:
    """`{"object": "list", "data": [embedding…], "model", "usage"}`; never streamed (the stream
    methods are a caller's bug). `encoding_format: "base64"` (what the openai SDK asks for by
    default) sends each vector as `float32_base64`."""

    media_type = "application/json"

    def __init__(self, request_id: str, model: str, request: dict[str, Any]) -> None:
        self.request_id = request_id
        self.model = model
        self.base64 = request.get("encoding_format") == "base64"
        self.data: list[dict[str, Any]] = []

    def stream_start(self) -> list[bytes]:
        raise TypeError("embeddings are never streamed")

    def stream_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        raise TypeError("embeddings are never streamed")

    def stream_end(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> list[bytes]:
        raise TypeError("embeddings are never streamed")

    def stream_error(self, error: ApiError) -> list[bytes]:
        raise TypeError("embeddings are never streamed")

    def collect(self, chunk: dict[str, Any]) -> None:
        for item in chunk.get("data") or ():
            vector = [float(x) for x in item.get("embedding") or ()]
            self.data.append({"object": "embedding", "index": item.get("index", len(self.data)),
                              "embedding": float32_base64(vector) if self.base64 else vector})

    def response(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        data = sorted(self.data, key=lambda item: item["index"])
        counts = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}
        return {"object": "list", "data": data, "model": self.model, "usage": with_cost(counts, cost_micro_usd)}

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()
