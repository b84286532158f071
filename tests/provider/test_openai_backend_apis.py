"""The OpenAI-compatible upstream backend beyond plain chat, against a scripted upstream: tools and
structured output passed through, legacy completions, embeddings, errors with their param,
per-model capabilities from provider.toml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from darkbloom.provider.backends import create_backend
from darkbloom.provider.backends.base import TEXT_MODEL_CAPABILITIES, BackendError, UsageMeter
from darkbloom.provider.backends.streams import open_stream
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend
from darkbloom.provider.config import ConfigError, load_config
from darkbloom.paths import provider_config_path
from tests.support.scripted_upstream import scripted_upstream

SECRET = "the-secret-prompt-words"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
PASSED = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
          "functions": [TOOLS[0]["function"]], "function_call": "auto", "logprobs": True, "top_logprobs": 2,
          "logit_bias": {"5": -100}, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": {"type": "object"}}}}


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


class Upstream:
    """Answers each endpoint from a script and keeps what it was sent."""

    def __init__(self, answers: dict[str, httpx.Response]) -> None:
        self.answers = answers
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.path, json.loads(request.content)))
        return self.answers[request.url.path]


async def run(upstream: Upstream, api: str, body: dict[str, Any], meter: UsageMeter | None = None,
              **kwargs: Any) -> list[dict[str, Any]]:
    async with scripted_upstream(upstream) as url:
        backend = OpenAIUpstreamBackend(url + "/v1", ["m"], **kwargs)
        await backend.start()
        try:
            return [c async for c in open_stream(backend, api, "m", body, meter)]  # type: ignore[arg-type]
        finally:
            await backend.close()


def stream_response(events: list[dict[str, Any]]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(events))


async def test_chat_parameters_and_tool_call_deltas_pass_through() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    events = [{"id": "u", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}, "finish_reason": None}]},
        {"id": "u", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
             "finish_reason": "tool_calls"}]}]
    upstream = Upstream({"/v1/chat/completions": stream_response(events)})
    meter = UsageMeter()
    chunks = await run(upstream, "chat", {"messages": [{"role": "user", "content": "hi"}], **PASSED}, meter)
    [(path, sent)] = upstream.seen
    assert path == "/v1/chat/completions" and all(sent[k] == v for k, v in PASSED.items())
    assert chunks[0]["choices"][0]["delta"]["tool_calls"] == [call]
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == 2 == meter.completion_tokens  # a tool delta is a step


async def test_completions_stream_from_the_upstream() -> None:
    events = [{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": f}]}
              for t, f in (("Once", None), (" upon", "length"))]
    events.append({"id": "c", "object": "text_completion", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    upstream = Upstream({"/v1/completions": stream_response(events)})
    chunks = await run(upstream, "completions", {"prompt": "Tell", "max_tokens": 2, "logprobs": 1, "echo": False})
    [(path, sent)] = upstream.seen
    assert path == "/v1/completions"
    assert sent == {"prompt": "Tell", "max_tokens": 2, "logprobs": 1, "echo": False, "model": "m", "stream": True,
                    "stream_options": {"include_usage": True}}
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Once", " upon"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["object"] == "text_completion"
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 and chunks[-1]["usage"]["completion_tokens"] == 2


async def test_embeddings_are_one_upstream_call() -> None:
    answer = {"object": "list", "model": "m", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]},
                                                       {"object": "embedding", "index": 1, "embedding": [0.3, 0.4]}],
              "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    upstream = Upstream({"/v1/embeddings": httpx.Response(200, json=answer)})
    meter = UsageMeter()
    data, usage = await run(upstream, "embeddings", {"input": ["a", "b"]}, meter)
    assert upstream.seen == [("/v1/embeddings", {"input": ["a", "b"], "model": "m", "encoding_format": "float"})]
    assert data == {"object": "list", "data": answer["data"]}
    assert usage["choices"] == [] and (usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"]) == (7, 0)
    assert meter.prompt_tokens == 7


@pytest.mark.parametrize("api, path", [("chat", "/v1/chat/completions"), ("completions", "/v1/completions"),
                                       ("embeddings", "/v1/embeddings")])
async def test_an_upstream_400_keeps_its_param_and_code_never_its_message(api: str, path: str) -> None:
    error = {"error": {"message": f"your prompt '{SECRET}' is too long", "type": "invalid_request_error",
                       "param": "messages", "code": "context_length_exceeded"}}
    upstream = Upstream({path: httpx.Response(400, json=error)})
    with pytest.raises(BackendError) as info:
        await run(upstream, api, {"messages": [], "prompt": SECRET, "input": SECRET})
    exc = info.value
    assert (exc.status_code, exc.param, exc.code) == (400, "messages", "context_length_exceeded")
    assert SECRET not in exc.message


async def test_free_text_in_param_and_unknown_codes_are_dropped() -> None:
    error = {"error": {"message": SECRET, "type": "invalid_request_error", "param": f"bad {SECRET}",
                       "code": "some_code"}}
    upstream = Upstream({"/v1/chat/completions": httpx.Response(400, json=error)})
    with pytest.raises(BackendError) as info:
        await run(upstream, "chat", {"messages": []})
    assert (info.value.param, info.value.code) == (None, None)


@pytest.mark.parametrize("answer", [{"data": [{"embedding": "AAAA"}]}, {"nope": 1}, [1, 2]])
async def test_embeddings_that_are_not_floats_are_502(answer: Any) -> None:
    upstream = Upstream({"/v1/embeddings": httpx.Response(200, json=answer)})
    with pytest.raises(BackendError) as info:
        await run(upstream, "embeddings", {"input": "a"})
    assert info.value.status_code == 502


def test_capabilities_default_and_configured_per_model(home: Path) -> None:
    provider_config_path(home).write_text(
        '[backend]\nkind = "openai"\nupstream_url = "http://127.0.0.1:9"\n\n'
        '[[models]]\nid = "chatty"\ncapabilities = ["tools"]\n\n[[models]]\nid = "full"\n')
    backend = create_backend(load_config(home, {}))
    assert isinstance(backend, OpenAIUpstreamBackend)
    assert backend.capabilities("chatty") == {"tools"}
    assert backend.capabilities("full") == TEXT_MODEL_CAPABILITIES
    assert backend.capabilities("other") == frozenset()
    provider_config_path(home).write_text('[backend]\nkind = "openai"\nupstream_url = "http://127.0.0.1:9"\n\n'
                                          '[[models]]\nid = "x"\ncapabilities = ["telepathy"]\n')
    with pytest.raises(ConfigError, match="telepathy"):
        load_config(home, {})
