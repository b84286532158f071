"""Any OpenAI-compatible server as the backend (Ollama, llama.cpp server, vLLM, LM Studio, …).

The node always streams from the upstream with `stream_options.include_usage`, passes the
content chunks through and takes the token counts from the upstream's final usage chunk.
Bounding concurrency is the node's job, not this module's.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, AsyncIterator

import httpx

from darkbloom.provider.backends.base import BackendError, new_completion_id, usage_chunk

log = logging.getLogger(__name__)


def chat_completions_url(upstream_url: str) -> str:
    """`http://host:port`, `http://host:port/v1` and `…/v1/` all name the same endpoint."""
    base = upstream_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


class OpenAIUpstreamBackend:
    def __init__(self, upstream_url: str, model_ids: list[str], *, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, read_timeout: float = 300.0) -> None:
        self.url = chat_completions_url(upstream_url)
        self.model_ids = list(model_ids)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=30.0, pool=None)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self._timeout, transport=self._transport, headers=self._headers)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def stream_chat(self, model_id: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if self._client is None:
            raise BackendError(503, "the upstream backend is not started")
        if model_id not in self.model_ids:
            raise BackendError(404, f"model {model_id!r} is not served by this node")
        payload = {**body, "model": model_id, "stream": True,
                   "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        usage: dict[str, Any] | None = None
        content_chunks = 0
        completion_id, created = new_completion_id(), None
        try:
            async with self._client.stream("POST", self.url, json=payload) as response:
                if response.status_code >= 400:
                    raise BackendError(response.status_code, _error_message(await response.aread(),
                                                                            response.status_code))
                async for chunk in _sse_chunks(response):
                    completion_id = chunk.get("id") or completion_id
                    created = chunk.get("created", created)
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    if not chunk.get("choices"):
                        continue
                    chunk.pop("usage", None)
                    content_chunks += sum(1 for c in chunk["choices"] if (c.get("delta") or {}).get("content"))
                    yield chunk
        except httpx.TimeoutException as exc:
            raise BackendError(504, f"upstream {self.url} timed out: {type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise BackendError(502, f"upstream {self.url} failed: {type(exc).__name__}: {exc}") from None
        if usage is not None and _valid_usage(usage):
            prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        else:
            # The upstream sent no usage (llama-cpp-python's server, for one, ignores include_usage
            # when streaming). Estimate: ~4 characters per prompt token plus a few per message for
            # the chat template, and one token per content chunk (servers stream about a token each).
            prompt, completion = _estimate_prompt_tokens(body), content_chunks
            log.debug("upstream sent no usage; estimated %d prompt / %d completion tokens", prompt, completion)
        yield usage_chunk(completion_id, model_id, created, prompt, completion)


async def _sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise BackendError(502, "upstream sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise BackendError(502, "upstream sent an event that is not a JSON object")
        if "error" in chunk:
            raise BackendError(502, f"upstream failed mid-stream: {_message_of(chunk)}")
        yield chunk
    # Without [DONE] the upstream failed after sending its headers (some servers report a
    # too-long prompt this way); a truncated answer must not pass for a complete one.
    raise BackendError(502, "upstream closed the stream before it was complete")


def _valid_usage(usage: dict[str, Any]) -> bool:
    return all(isinstance(usage.get(k), int) and usage[k] >= 0 for k in ("prompt_tokens", "completion_tokens"))


def _error_message(raw: bytes, status: int) -> str:
    try:
        return _message_of(json.loads(raw))
    except ValueError:
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or f"upstream returned HTTP {status}"


def _message_of(data: Any) -> str:
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
        if isinstance(data.get("detail"), (str, list)):
            return str(data["detail"])[:500]
    return json.dumps(data)[:500]


def _estimate_prompt_tokens(body: dict[str, Any]) -> int:
    chars, messages = 0, body.get("messages") or []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return math.ceil(chars / 4) + 4 * len(messages if isinstance(messages, list) else [])
