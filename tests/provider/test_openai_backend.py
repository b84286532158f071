"""The OpenAI-compatible upstream backend against a real third-party server (llama-cpp-python's own
`llama_cpp.server` on the bundled model), plus a scripted upstream for what that server never sends."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest

from darkbloom.provider.backends.base import BackendError, UsageMeter
from darkbloom.provider.backends.openai_upstream import (OpenAIUpstreamBackend, _estimate_prompt_tokens,
                                                         chat_completions_url, proxy_for)
from tests.support.scripted_upstream import Handler, Scripted

HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def stream(backend: OpenAIUpstreamBackend, body: dict[str, Any],
                 model: str = "smollm2-135m") -> list[dict[str, Any]]:
    return [chunk async for chunk in backend.stream_chat(model, body)]


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
async def test_streams_through_a_real_upstream(upstream: str, suffix: str) -> None:
    backend = OpenAIUpstreamBackend(upstream + suffix, ["smollm2-135m"])
    await backend.start()
    try:
        *content, final = await stream(backend, HELLO)
    finally:
        await backend.close()
    assert content and all(c["object"] == "chat.completion.chunk" and c["choices"] for c in content)
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text_chunks = [c for c in content if c["choices"][0]["delta"].get("content")]
    assert text_chunks
    # llama_cpp.server sends no usage when streaming: completion is one token per content chunk,
    # the prompt an estimate from its characters.
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == len(text_chunks)
    assert final["usage"]["prompt_tokens"] > 0


async def test_upstream_http_error_keeps_its_status_and_type_but_not_its_message(upstream: str) -> None:
    bad = {**HELLO, "temperature": "hot"}
    direct = httpx.post(upstream + "/v1/chat/completions", json={**bad, "model": "smollm2-135m", "stream": True})
    assert direct.status_code >= 400
    upstream_error = direct.json()["error"]
    backend = OpenAIUpstreamBackend(upstream, ["smollm2-135m"])
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, bad)
        # an early close leaves the backend usable
        partial = backend.stream_chat("smollm2-135m", {**HELLO, "max_tokens": 30})
        await partial.__anext__()
        await partial.aclose()
        assert (await stream(backend, HELLO))[-1]["usage"]["completion_tokens"] > 0
    finally:
        await backend.close()
    assert info.value.status_code == direct.status_code
    verb = "rejected the request" if direct.status_code < 500 else "failed to serve the request"
    assert info.value.message == f"the upstream {verb} ({direct.status_code} {upstream_error['type']})"
    assert upstream_error["message"] not in info.value.message and "hot" not in info.value.message


async def test_a_partial_stream_meters_the_content_chunks_seen(upstream: str) -> None:
    backend = OpenAIUpstreamBackend(upstream, ["smollm2-135m"])
    await backend.start()
    meter = UsageMeter()
    body = {"messages": [{"role": "user", "content": "Write a long story about a cat."}], "max_tokens": 200}
    try:
        partial = backend.stream_chat("smollm2-135m", body, meter)
        seen = 0
        async for chunk in partial:
            seen += bool(chunk["choices"][0]["delta"].get("content"))
            if seen == 4:
                break
        await partial.aclose()
    finally:
        await backend.close()
    assert (meter.prompt_tokens, meter.completion_tokens) == (_estimate_prompt_tokens(body), 4)
    assert await meter.stopped(0)  # nothing outlives the closed HTTP stream


async def test_unreachable_upstream_is_502() -> None:
    backend = OpenAIUpstreamBackend(f"http://127.0.0.1:{_free_port()}", ["m"])
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert info.value.status_code == 502


def test_chat_completions_url() -> None:
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("https://h/openai/v1") == "https://h/openai/v1/chat/completions"


# What llama_cpp.server never sends (usage, mid-stream errors) comes from a scripted upstream.

def _scripted(events: list[str], seen: list[dict[str, Any]]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = "".join(f"data: {event}\n\n" for event in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    return handler


def _chunk(content: str | None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    data: dict[str, Any] = {"id": "up-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": choices}
    if usage is not None:
        data["usage"] = usage
    return json.dumps(data)


async def test_upstream_usage_is_passed_on_and_requested(scripted: Scripted) -> None:
    seen: list[dict[str, Any]] = []
    events = [_chunk("Hel"), _chunk("lo", "stop"), _chunk(None, usage={"prompt_tokens": 11, "completion_tokens": 2,
                                                                      "total_tokens": 13}), "[DONE]"]
    backend = OpenAIUpstreamBackend(await scripted(_scripted(events, seen)), ["m"])
    await backend.start()
    try:
        chunks = await stream(backend, {**HELLO, "stream": False}, "m")
    finally:
        await backend.close()
    assert [c["choices"][0].get("finish_reason") for c in chunks[:-1]] == [None, "stop"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["model"] == "m"


async def test_the_upstreams_cached_tokens_are_passed_on(scripted: Scripted) -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13,
             "prompt_tokens_details": {"cached_tokens": 8}}
    events = [_chunk("Hel", "stop"), _chunk(None, usage=usage), "[DONE]"]
    backend = OpenAIUpstreamBackend(await scripted(_scripted(events, [])), ["m"])
    await backend.start()
    try:
        chunks = await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert chunks[-1]["usage"] == usage


SECRET = "the-secret-prompt-words"


@pytest.mark.parametrize("events, message", [
    ([_chunk("Hel")], "upstream closed the stream before it was complete"),
    ([_chunk("Hel"), json.dumps({"error": {"message": f"out of memory after '{SECRET}'", "type": "server_error",
                                           "code": 507}})], "the upstream failed mid-stream (server_error, 507)"),
    ([_chunk("Hel"), json.dumps({"error": f"failed on {SECRET}"})], "the upstream failed mid-stream"),
    (["not json"], "upstream sent an event that is not JSON"),
])
async def test_broken_streams_are_502(scripted: Scripted, events: list[str], message: str) -> None:
    backend = OpenAIUpstreamBackend(await scripted(_scripted(events, [])), ["m"])
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert (info.value.status_code, info.value.message) == (502, message)


@pytest.mark.parametrize("status, body, message", [
    (400, {"error": {"message": f"This model's maximum context length is 8 tokens; your prompt '{SECRET}' is 9",
                     "type": "invalid_request_error", "code": "context_length_exceeded", "param": "messages"}},
     "the upstream rejected the request (400 invalid_request_error, context_length_exceeded)"),
    (422, {"detail": [{"msg": "bad", "input": SECRET}]}, "the upstream rejected the request (422)"),
    (400, {"error": {"message": SECRET, "type": f"bad {SECRET}", "code": None}},
     "the upstream rejected the request (400)"),  # free text in `type` is dropped too
    (500, f"Traceback ... {SECRET}", "the upstream failed to serve the request (500)"),
    (503, {"error": {"message": SECRET, "type": "overloaded", "code": "overloaded"}},
     "the upstream failed to serve the request (503 overloaded)"),
])
async def test_upstream_errors_pass_on_status_and_type_never_text(scripted: Scripted, status: int, body: Any,
                                                                 message: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    backend = OpenAIUpstreamBackend(await scripted(handler), ["m"])
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, {"messages": [{"role": "user", "content": SECRET}]}, "m")
    finally:
        await backend.close()
    assert (info.value.status_code, info.value.message) == (status, message)


class _Stalling(httpx.AsyncByteStream):
    """Sends `events`, then nothing until closed (an upstream still generating)."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.closed = events, asyncio.Event()

    async def __aiter__(self) -> Any:
        for event in events_as_bytes(self.events):
            yield event
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


def events_as_bytes(events: list[str]) -> list[bytes]:
    return [f"data: {event}\n\n".encode() for event in events]


@pytest.mark.parametrize("usage_per_chunk", [False, True])
async def test_meter_after_an_early_close(scripted: Scripted, usage_per_chunk: bool) -> None:
    """No usage yet: the prompt estimate and one token per content chunk. An upstream that streams
    usage with every chunk (vLLM's continuous usage stats): its own counts."""
    events = [_chunk(text, usage={"prompt_tokens": 21, "completion_tokens": 2 * n} if usage_per_chunk else None)
              for n, text in enumerate(["Once", " upon", " a"], 1)]
    upstream_stream = _Stalling(events)
    url = await scripted(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=upstream_stream))
    backend = OpenAIUpstreamBackend(url, ["m"])
    await backend.start()
    meter = UsageMeter()
    try:
        chunks = backend.stream_chat("m", HELLO, meter)
        assert (meter.prompt_tokens, meter.completion_tokens) == (0, 0)  # the upstream has not taken it yet
        for _ in range(3):
            await chunks.__anext__()
        await chunks.aclose()
    finally:
        await backend.close()
    await asyncio.wait_for(upstream_stream.closed.wait(), 10)  # the backend closed the connection
    expected = (21, 6) if usage_per_chunk else (_estimate_prompt_tokens(HELLO), 3)
    assert (meter.prompt_tokens, meter.completion_tokens) == expected


# One pool of keep-alive connections for the backend's lifetime: a real HTTP/1.1 server that counts them.

async def _counting_upstream(connections: list[int]) -> asyncio.AbstractServer:
    events = [_chunk("Hel"), _chunk("lo", "stop"), "[DONE]"]
    body = b"".join(events_as_bytes(events))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for event in (body[:40], body[40:]):  # [DONE] first, the end of the body in its own write
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_requests_reuse_one_pooled_connection() -> None:
    connections: list[int] = []
    server = await _counting_upstream(connections)
    port = server.sockets[0].getsockname()[1]
    backend = OpenAIUpstreamBackend(f"http://127.0.0.1:{port}", ["m"], max_concurrency=4)
    await backend.start()
    try:
        for _ in range(5):
            assert (await stream(backend, HELLO, "m"))[-1]["usage"]["completion_tokens"] == 2
        await asyncio.gather(*(stream(backend, HELLO, "m") for _ in range(4)))
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    assert 1 <= len(connections) <= 4  # one for the sequential requests, at most max_concurrency at once


# What the client must not do: follow a redirect (the prompt would go wherever Location says), read
# ~/.netrc (its credentials would go upstream), choke on SSE's other line endings, fail a whole answer
# when the connection breaks after [DONE].

async def test_a_redirect_is_not_followed(scripted: Scripted) -> None:
    elsewhere: list[str] = []

    def other(request: httpx.Request) -> httpx.Response:
        elsewhere.append(request.method)
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    target = await scripted(other)
    backend = OpenAIUpstreamBackend(await scripted(
        lambda request: httpx.Response(307, headers={"location": target + "/v1/chat/completions"})), ["m"])
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert info.value.status_code == 502 and "redirect (307)" in info.value.message
    assert elsewhere == []


async def test_netrc_credentials_are_never_sent(scripted: Scripted, tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("default login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return _scripted([_chunk("Hi", "stop"), "[DONE]"], [])(request)

    for api_key in (None, "sk-upstream"):
        backend = OpenAIUpstreamBackend(await scripted(handler), ["m"], api_key=api_key)
        await backend.start()
        try:
            await stream(backend, HELLO, "m")
        finally:
            await backend.close()
    assert seen == [None, "Bearer sk-upstream"]


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
async def test_every_sse_line_ending_is_read(scripted: Scripted, ending: str) -> None:
    events = [_chunk("Hel"), _chunk("lo", "stop"), "[DONE]"]
    body = "".join(f"data: {event}{ending}{ending}" for event in events).encode()
    backend = OpenAIUpstreamBackend(await scripted(lambda request: httpx.Response(200, content=body)), ["m"])
    await backend.start()
    try:
        chunks = await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello"


async def test_a_connection_broken_after_done_still_completes_the_answer() -> None:
    body = b"".join(events_as_bytes([_chunk("Hel"), _chunk("lo", "stop"), "[DONE]"]))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(body), body))  # and never the last chunk of the encoding
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = OpenAIUpstreamBackend(f"http://127.0.0.1:{port}", ["m"])
    await backend.start()
    try:
        chunks = await stream(backend, HELLO, "m")
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_the_proxy_comes_from_the_environment_unless_no_proxy_exempts_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert proxy_for("http://upstream:8000/v1/chat/completions") is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert proxy_for("http://upstream:8000/v1/chat/completions") == "http://proxy:3128"
    monkeypatch.setenv("NO_PROXY", "upstream")
    assert proxy_for("http://upstream:8000/v1/chat/completions") is None
