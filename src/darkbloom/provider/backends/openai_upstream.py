"""Any OpenAI-compatible server as the backend (Ollama, llama.cpp server, vLLM, LM Studio, …).

The node always streams from the upstream with `stream_options.include_usage`, passes the
content chunks through and takes the token counts from the upstream's final usage chunk.
Bounding concurrency is the node's job, not this module's; the backend keeps one pool of keep-alive
connections to its upstream for its lifetime (one aiohttp session), as many as the node's
`max_concurrency`, and reads each answer to its end (past `[DONE]`) so that its connection goes back
to the pool for the next request instead of being closed. aiohttp, not httpx, on this path: the
node's whole job per request is one streamed upstream call, and httpx cost several times aiohttp's
CPU for each (encode/httpcore#1035's pool bookkeeping among it; bench/RESULTS.md).

Partial usage (a request stopped early): the `UsageMeter` always holds what the final usage chunk
would say if the stream ended now — the upstream's own counts once a usage object has arrived
(only at the end, unless the server streams usage with every chunk), else the estimate: prompt
tokens from the characters of the messages, counted from the moment the upstream accepts the
request, and one completion token per content chunk seen (servers stream about one token per
chunk; a server that batches several tokens into a chunk is under-counted).

Errors: an upstream's error text can quote the prompt (a too-long prompt, a bad message), and
`inference_error` messages leave the node unsealed, so a `BackendError` carries only the upstream's
status and its error `type`/`code` identifiers inside a sentence of our own, never its message; its
`param` (when it is an identifier) and a `code` we pass on (`PROVIDER_ERROR_CODES`) go with it.

Every chat parameter (tools, tool_choice, response_format, logprobs, logit_bias, …) goes to the
upstream as the client sent it. Legacy completions stream from the upstream's /v1/completions;
embeddings are one (unstreamed) call to its /v1/embeddings, asked for floats. What each model
serves beyond chat is configured per model (`capabilities` in its [[models]] table).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import ssl
import urllib.parse
import urllib.request
from typing import Any, AsyncIterator

import aiohttp
import certifi

from darkbloom.provider.backends.base import (TEXT_MODEL_CAPABILITIES, BackendError, UsageMeter,
                                              new_completion_id, usage_chunk)
from darkbloom.provider.backends.upstream_stream import sse_chunks, upstream_error
from darkbloom.wire import json_codec

log = logging.getLogger(__name__)
KEEPALIVE_EXPIRY = 4.0  # seconds an idle connection is kept: under uvicorn's 5 s (vLLM, llama.cpp's server)
POOL_TIMEOUT = 30.0     # waiting this long for a free connection means one leaked: fail, never hang


def api_base(upstream_url: str) -> str:
    """`http://host:port`, `http://host:port/v1` and `…/v1/` all name the same API."""
    base = upstream_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def chat_completions_url(upstream_url: str) -> str:
    return api_base(upstream_url) + "/chat/completions"


class OpenAIUpstreamBackend:
    def __init__(self, upstream_url: str, model_ids: list[str], *, api_key: str | None = None,
                 max_concurrency: int = 2, read_timeout: float = 300.0,
                 capabilities: dict[str, frozenset[str]] | None = None) -> None:
        self.url = chat_completions_url(upstream_url)
        self.completions_url = api_base(upstream_url) + "/completions"
        self.embeddings_url = api_base(upstream_url) + "/embeddings"
        self.model_ids = list(model_ids)
        self._capabilities = {m: (capabilities or {}).get(m, TEXT_MODEL_CAPABILITIES) for m in self.model_ids}
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        # `connect` covers waiting for a pooled connection too: this long means one leaked — fail, never hang
        self._timeout = aiohttp.ClientTimeout(total=None, connect=POOL_TIMEOUT, sock_connect=10.0,
                                              sock_read=read_timeout)
        self._client: aiohttp.ClientSession | None = None
        self._proxy: str | None = None

    async def start(self) -> None:
        # what httpx did by default: certifi's CA bundle, HTTP(S)_PROXY / NO_PROXY read once (aiohttp's
        # trust_env would also read ~/.netrc on every request and send its credentials upstream)
        tls = ssl.create_default_context(cafile=certifi.where())
        connector = aiohttp.TCPConnector(limit=self.max_concurrency, keepalive_timeout=KEEPALIVE_EXPIRY, ssl=tls)
        self._proxy = proxy_for(self.url)
        self._client = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers,
                                             json_serialize=json_codec.dumps_text)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def capabilities(self, model_id: str) -> frozenset[str]:
        return self._capabilities.get(model_id, frozenset())

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(self._stream(self.url, model_id, body, meter, _estimate_prompt_tokens(body),
                                                    "chat.completion.chunk", _chat_step)) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_completion(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        prompt = body.get("prompt")
        estimate = math.ceil(len(json.dumps(prompt)) / 4) if prompt is not None else 0
        async with contextlib.aclosing(self._stream(self.completions_url, model_id, body, meter, estimate,
                                                    "text_completion", _text_step)) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_embeddings(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        client = self._started(model_id)
        meter = meter if meter is not None else UsageMeter()
        payload = {**body, "model": model_id, "encoding_format": "float"}
        try:
            async with client.post(self.embeddings_url, json=payload, allow_redirects=False,
                                   proxy=self._proxy) as response:
                raw = await response.read()
            if response.status >= 300:
                raise upstream_error(response.status, raw)
            data = json.loads(raw)
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors
            raise BackendError(504, f"the upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:
            raise BackendError(502, f"the connection to the upstream failed ({type(exc).__name__})") from None
        except ValueError:
            raise BackendError(502, "the upstream's embeddings are not JSON") from None
        vectors = data.get("data") if isinstance(data, dict) else None
        if not isinstance(vectors, list) or not all(
                isinstance(v, dict) and isinstance(v.get("embedding"), list) for v in vectors):
            raise BackendError(502, "the upstream's answer holds no float embeddings")
        usage = data.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        meter.prompt_tokens = tokens if isinstance(tokens, int) and tokens >= 0 else \
            math.ceil(len(json.dumps(body.get("input"))) / 4)
        yield {"object": "list", "data": [{"object": "embedding", "index": v.get("index", i),
                                           "embedding": v["embedding"]} for i, v in enumerate(vectors)]}
        yield usage_chunk(new_completion_id("embd"), model_id, None, meter.prompt_tokens, 0, object_name="list")

    def _started(self, model_id: str) -> aiohttp.ClientSession:
        if self._client is None:
            raise BackendError(503, "the upstream backend is not started")
        if model_id not in self.model_ids:
            raise BackendError(404, f"model {model_id!r} is not served by this node", param="model")
        return self._client

    async def _stream(self, url: str, model_id: str, body: dict[str, Any], meter: UsageMeter | None,
                      estimate: int, object_name: str, step: Any) -> AsyncIterator[dict[str, Any]]:
        client = self._started(model_id)
        meter = meter if meter is not None else UsageMeter()
        payload = {**body, "model": model_id, "stream": True,
                   "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        upstream_usage = False
        cached: int | None = None  # the upstream's cached prompt tokens, when it says
        content_chunks = 0
        completion_id, created = new_completion_id(), None
        try:
            async with client.post(url, json=payload, allow_redirects=False, proxy=self._proxy) as response:
                if response.status >= 300:
                    raise upstream_error(response.status, await response.read())
                # The upstream took the request. Until it reports usage (llama-cpp-python's server, for
                # one, never does when streaming): ~4 characters per prompt token plus a few per message
                # for the chat template, and one token per content chunk.
                meter.prompt_tokens, meter.completion_tokens = estimate, 0
                async for chunk in sse_chunks(response):
                    completion_id = chunk.get("id") or completion_id
                    created = chunk.get("created", created)
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and _valid_usage(usage):
                        upstream_usage = True
                        meter.prompt_tokens = int(usage["prompt_tokens"])
                        meter.completion_tokens = int(usage["completion_tokens"])
                        cached = _cached_tokens(usage)
                        meter.cached_tokens = cached or 0
                    if not chunk.get("choices"):
                        continue
                    chunk.pop("usage", None)
                    content_chunks += sum(1 for c in chunk["choices"] if isinstance(c, dict) and step(c))
                    if not upstream_usage:
                        meter.completion_tokens = content_chunks
                    yield chunk
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors
            log.warning("upstream %s timed out: %s", url, type(exc).__name__)
            raise BackendError(504, f"the upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:
            log.warning("upstream %s failed: %s: %s", url, type(exc).__name__, exc)
            raise BackendError(502, f"the connection to the upstream failed ({type(exc).__name__})") from None
        if not upstream_usage:
            log.debug("upstream sent no usage; estimated %d prompt / %d completion tokens", meter.prompt_tokens,
                      meter.completion_tokens)
        yield usage_chunk(completion_id, model_id, created, meter.prompt_tokens, meter.completion_tokens,
                          object_name=object_name, cached_tokens=cached)


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    """The upstream's `prompt_tokens_details.cached_tokens` (llama-server, vLLM and OpenAI send it), None
    when it does not say; `chunk_usage` holds it within the prompt's tokens."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def _chat_step(choice: dict[str, Any]) -> bool:
    """Whether a chat choice carries generated tokens (content, or a tool call's name or arguments)."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("function_call")
                or delta.get("reasoning_content"))


def _text_step(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text"))


def _valid_usage(usage: dict[str, Any]) -> bool:
    return all(isinstance(usage.get(k), int) and usage[k] >= 0 for k in ("prompt_tokens", "completion_tokens"))


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (HTTP_PROXY / HTTPS_PROXY), unless NO_PROXY exempts it."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies().get(urllib.parse.urlsplit(url).scheme)


def _estimate_prompt_tokens(body: dict[str, Any]) -> int:
    chars, messages = 0, body.get("messages") or []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return math.ceil(chars / 4) + 4 * len(messages if isinstance(messages, list) else [])
