"""The OpenAI-compatible upstream backend against a real third-party server (llama-cpp-python's own
`llama_cpp.server` on the bundled model), plus a scripted transport for what that server never sends."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.openai_upstream import OpenAIUpstreamBackend, chat_completions_url

HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}

# llama_cpp.server, started through our backend module so the same llama.cpp workaround applies
# (see _disable_extra_buffer_types: AMX kernels crash on some VMs).
_SERVER = ("import sys, runpy; import darkbloom.provider.backends.llama_cpp; "
           "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def upstream(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("upstream") / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, "--model", str(gguf), "--model_alias", "smollm2-135m",
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024", "--n_threads", "1"],
            stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"llama_cpp.server exited: {log_path.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


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


async def test_upstream_http_error_keeps_its_status_and_message(upstream: str) -> None:
    bad = {**HELLO, "temperature": "hot"}
    direct = httpx.post(upstream + "/v1/chat/completions", json={**bad, "model": "smollm2-135m", "stream": True})
    assert direct.status_code >= 400
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
    assert "temperature" in info.value.message


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


# What llama_cpp.server never sends (usage, mid-stream errors) comes from a scripted transport.

def _scripted(events: list[str], seen: list[dict[str, Any]]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = "".join(f"data: {event}\n\n" for event in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    return httpx.MockTransport(handler)


def _chunk(content: str | None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    data: dict[str, Any] = {"id": "up-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": choices}
    if usage is not None:
        data["usage"] = usage
    return json.dumps(data)


async def test_upstream_usage_is_passed_on_and_requested() -> None:
    seen: list[dict[str, Any]] = []
    events = [_chunk("Hel"), _chunk("lo", "stop"), _chunk(None, usage={"prompt_tokens": 11, "completion_tokens": 2,
                                                                      "total_tokens": 13}), "[DONE]"]
    backend = OpenAIUpstreamBackend("http://upstream", ["m"], transport=_scripted(events, seen))
    await backend.start()
    try:
        chunks = await stream(backend, {**HELLO, "stream": False}, "m")
    finally:
        await backend.close()
    assert [c["choices"][0].get("finish_reason") for c in chunks[:-1]] == [None, "stop"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["model"] == "m"


@pytest.mark.parametrize("events, needle", [
    ([_chunk("Hel")], "before it was complete"),
    ([_chunk("Hel"), json.dumps({"error": {"message": "out of memory"}})], "out of memory"),
    (["not json"], "not JSON"),
])
async def test_broken_streams_are_502(events: list[str], needle: str) -> None:
    backend = OpenAIUpstreamBackend("http://upstream", ["m"], transport=_scripted(events, []))
    await backend.start()
    try:
        with pytest.raises(BackendError) as info:
            await stream(backend, HELLO, "m")
    finally:
        await backend.close()
    assert info.value.status_code == 502 and needle in info.value.message
