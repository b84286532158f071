"""The direct-mode ASGI app in process: auth, OpenAI shapes, errors, the shared concurrency limit.

Happy paths run on the real llama.cpp backend with the bundled model. The error paths use
`scripted_backend`, a stand-in (a `MockBackend`, not a model) that fails exactly where a test needs it
to, or sends exactly the chunks a test needs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.provider.bundled_model import bundled_gguf_path
from darkbloom.provider.backends import BackendError
from darkbloom.provider.backends.base import usage_chunk
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.direct.server import create_app
from darkbloom.provider.slots import Slots
from tests.support.backends import BackendCall, FailingBackend, MockBackend

TOKEN = "dk-local-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "smollm2-135m"
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def scripted_backend(contents: list[str], fail_at: int | None = None, status: int = 502,
                     gate: asyncio.Event | None = None, chunks: list[dict[str, Any]] | None = None) -> MockBackend:
    """Stand-in backend for error paths: yields `contents` as chunks (or, given, `chunks`: the `choices`
    of each chunk), failing at index `fail_at`; with `gate`, only once the gate is set."""

    async def handler(call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        if gate is not None:
            await gate.wait()
        choices = chunks or [{"index": 0, "delta": {"content": text}, "finish_reason": None} for text in contents]
        for index, choice in enumerate(choices):
            if index == fail_at:
                raise BackendError(status, "scripted failure")
            yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": call.model_id,
                   "choices": [choice]}
        if fail_at == len(choices):
            raise BackendError(status, "scripted failure")
        yield usage_chunk("x", call.model_id, 1, 3, len(contents))

    return MockBackend(handler)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


def events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def idle(slots: Slots) -> None:
    while slots.active:  # bounded by the test timeout
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return bundled_gguf_path()


@pytest.fixture
async def llama(gguf: Path) -> AsyncIterator[LlamaCppBackend]:
    backend = LlamaCppBackend({MODEL: gguf}, max_concurrency=1, n_ctx=512)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


async def test_health_is_open_everything_else_needs_the_token() -> None:
    app = create_app(scripted_backend(["hi"]), Slots(1), [MODEL], TOKEN)
    async with client(app) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        for headers in ({}, {"Authorization": "Bearer dk-local-wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
                response = await http.request(method, path, headers=headers, json=HELLO)
                assert response.status_code == 401, (headers, path)
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("invalid_api_key", "invalid_api_key")
                assert set(error) == {"message", "type", "code", "param"} and "local_token" in error["message"]
        models = await http.get("/v1/models", headers={"Authorization": f"bearer {TOKEN}"})
        assert models.status_code == 200
        assert models.json() == {"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": models.json()["data"][0]["created"], "owned_by": "self"}]}
        assert (await http.get(f"/v1/models/{MODEL}", headers=AUTH)).json()["id"] == MODEL
        missing = await http.get("/v1/models/other", headers=AUTH)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
        nowhere = await http.get("/nowhere", headers=AUTH)
        assert (nowhere.status_code, nowhere.json()["error"]["type"]) == (404, "not_found")


async def test_completion_and_stream_on_the_real_model(llama: LlamaCppBackend) -> None:
    slots = Slots(1)
    app = create_app(llama, slots, [MODEL], TOKEN)
    async with client(app) as http:
        plain = await http.post("/v1/chat/completions", headers=AUTH, json=HELLO)
        assert plain.status_code == 200, plain.text
        body = plain.json()
        assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
        assert plain.headers["x-request-id"] == body["id"]
        assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
        usage = body["usage"]
        assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 8
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        await idle(slots)

        streamed = await http.post("/v1/chat/completions", headers=AUTH,
                                   json={**HELLO, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        parts = events(streamed.text)
        assert parts[-1] == "[DONE]" and parts.count("[DONE]") == 1
        chunks, final = parts[:-2], parts[-2]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == streamed.headers["x-request-id"]
                   and c["model"] == MODEL for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text and final["choices"] == [] and final["usage"]["completion_tokens"] <= 8
        assert text == body["choices"][0]["message"]["content"]  # temperature 0: the same answer
        await idle(slots)


async def test_request_errors_are_openai_envelopes() -> None:
    backend = scripted_backend(["hi"])
    app = create_app(backend, Slots(1), [MODEL], TOKEN)
    async with client(app) as http:
        cases = [
            (b"{not json", 400, "invalid_request_error", None),
            (b"[1, 2]", 400, "invalid_request_error", None),
            (json.dumps({"messages": []}).encode(), 400, "invalid_request_error", "model"),
            (json.dumps({**HELLO, "model": "other"}).encode(), 404, "model_not_found", "model"),
            (json.dumps({**HELLO, "stream": "yes"}).encode(), 400, "invalid_request_error", "stream"),
            (json.dumps({**HELLO, "n": 2}).encode(), 400, "invalid_request_error", "n"),  # the coordinator's checks
            (json.dumps({**HELLO, "messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(), 400,
             "invalid_request_error", "messages[0].content[0].text"),
            (b'{"model": "' + b"x" * (8 * 1024 * 1024) + b'"}', 413, "request_too_large", None),
        ]
        for raw, status, type_, param in cases:
            response = await http.post("/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                                       content=raw)
            assert response.status_code == status, (raw[:40], response.text)
            assert response.json()["error"]["type"] == type_ and response.json()["error"]["param"] == param
        assert response.json()["error"]["message"] == "The request body is larger than 8 MiB."
        assert not backend.calls


async def test_the_body_limit_is_the_configured_one() -> None:
    backend = scripted_backend(["hi"])
    app = create_app(backend, Slots(1), [MODEL], TOKEN, max_body_bytes=1024)
    async with client(app) as http:
        small = await http.post("/v1/chat/completions", headers=AUTH, json=HELLO)
        assert small.status_code == 200
        too_large = b'{"model": "' + b"x" * 1024 + b'"}'

        async def unsized() -> AsyncIterator[bytes]:  # no Content-Length: the reader counts as it reads
            yield too_large

        for content in (too_large, unsized()):
            large = await http.post("/v1/chat/completions", headers=AUTH, content=content)
            assert large.status_code == 413
            assert large.json()["error"] == {"message": "The request body is larger than 1 KiB.",
                                             "type": "request_too_large", "code": "request_too_large",
                                             "param": None}
        assert len(backend.calls) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failure_before_the_first_content_is_a_real_http_error(stream: bool) -> None:
    slots = Slots(1)
    app = create_app(scripted_backend(["never"], fail_at=0, status=400), slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", headers=AUTH, json={**HELLO, "stream": stream})
        assert response.status_code == 400
        assert response.json()["error"] == {"message": "scripted failure", "type": "invalid_request_error",
                                            "code": "invalid_request_error", "param": None}
    await idle(slots)


async def test_a_failure_after_the_first_content_ends_the_stream_with_an_error_event() -> None:
    slots = Slots(1)
    app = create_app(scripted_backend(["one", "two", "three"], fail_at=2), slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", headers=AUTH, json={**HELLO, "stream": True})
        assert response.status_code == 200
        parts = events(response.text)
        assert [p["choices"][0]["delta"]["content"] for p in parts[:-1]] == ["one", "two"]
        assert parts[-1]["error"]["type"] == "server_error" and "[DONE]" not in parts
    await idle(slots)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_failing_test_backend_answers_its_status(stream: bool) -> None:
    """What the direct-first e2e test gives a node as its direct-mode backend."""
    slots = Slots(1)
    backend = FailingBackend(500)
    app = create_app(backend, slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", headers=AUTH, json={**HELLO, "stream": stream})
        assert response.status_code == 500
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_error") and "test hook" in error["message"]
        assert (await http.get("/v1/models", headers=AUTH)).status_code == 200
    assert len(backend.calls) == 1
    await idle(slots)


ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
FINISH = {"index": 0, "delta": {}, "finish_reason": "stop"}
TOOL_CALL = {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                   "function": {"name": "f", "arguments": "{}"}}]},
             "finish_reason": None}


@pytest.mark.parametrize("choices, fail_at, status", [
    ([ROLE, FINISH], 2, 400),  # role and finish reason only, then a failure: nothing was sent yet
    ([ROLE, TOOL_CALL], 2, 200),  # a tool call is content (`has_content`): the stream has started
])
async def test_the_stream_starts_at_the_first_content(choices: list[dict[str, Any]], fail_at: int,
                                                      status: int) -> None:
    slots = Slots(1)
    app = create_app(scripted_backend([], fail_at=fail_at, status=400, chunks=choices), slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", headers=AUTH, json={**HELLO, "stream": True})
        assert response.status_code == status
        if status == 200:
            parts = events(response.text)
            assert [p["choices"][0] for p in parts[:-1]] == choices and "error" in parts[-1]
    await idle(slots)


async def test_a_reply_without_content_streams_whole() -> None:
    slots = Slots(1)
    app = create_app(scripted_backend([], chunks=[ROLE, FINISH]), slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post("/v1/chat/completions", headers=AUTH, json={**HELLO, "stream": True})
        assert response.status_code == 200
        parts = events(response.text)
        assert [p["choices"][0] for p in parts[:2]] == [ROLE, FINISH]
        assert parts[2] == "[DONE]"  # no usage chunk: the request did not ask for one
    await idle(slots)


async def test_direct_requests_share_the_fleet_concurrency_limit() -> None:
    slots = Slots(1)
    assert slots.try_acquire()  # a fleet request holds the node's only slot
    backend = scripted_backend(["hi"])
    app = create_app(backend, slots, [MODEL], TOKEN, queue_wait=30)
    async with client(app) as http:
        waiting = asyncio.create_task(http.post("/v1/chat/completions", headers=AUTH, json=HELLO))
        while not slots.waiting:  # bounded by the test timeout
            await asyncio.sleep(0.01)
        assert not backend.calls and not waiting.done()
        assert not slots.try_acquire()  # meanwhile a fleet request would be refused
        slots.release()  # the fleet request ends
        response = await waiting
        assert response.status_code == 200 and len(backend.calls) == 1
        await idle(slots)

        gate = asyncio.Event()
        slow = scripted_backend(["hi"], gate=gate)
        busy_app = create_app(slow, slots, [MODEL], TOKEN, queue_wait=0.05)
        async with client(busy_app) as busy_http:
            running = asyncio.create_task(busy_http.post("/v1/chat/completions", headers=AUTH, json=HELLO))
            while not slow.calls:  # the direct request now holds the slot
                await asyncio.sleep(0.01)
            assert not slots.try_acquire()  # a fleet request finds the node busy
            refused = await busy_http.post("/v1/chat/completions", headers=AUTH, json=HELLO)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
            gate.set()
            assert (await running).status_code == 200
        await idle(slots)
