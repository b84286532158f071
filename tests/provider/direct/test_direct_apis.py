"""Direct mode's other APIs (`/v1/completions`, `/v1/embeddings`, `/v1/responses`, `/v1/messages`) in
process, driven by the real openai and anthropic SDKs.

`api_backend` is a stand-in (a `MockBackend`, not a model) that sends exactly the chunks a test needs
(a tool call, a failure at a given point) for each node API; `test_direct_apis_real` runs the same APIs
on the bundled model.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import anthropic
import httpx
import openai
import pytest

from darkbloom.provider.backends import BackendError
from darkbloom.provider.backends.base import usage_chunk
from darkbloom.provider.direct.server import create_app
from darkbloom.provider.slots import Slots
from tests.provider.direct.test_local_server import AUTH, MODEL, TOKEN, client, idle
from tests.support.backends import BackendCall, MockBackend
from tests.wire.node_chunks import completion, sse_events, text_chunks, tool_chunks

EMBEDDING = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25, 1.0]}]}


def api_backend(chunks: dict[str, list[dict[str, Any]]], fail_at: int | None = None, status: int = 502,
                cached_tokens: int | None = None) -> MockBackend:
    """Yields `chunks[api]` for each node API, raising BackendError(`status`) at index `fail_at`."""

    async def handler(call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        scripted = chunks.get(call.api, [])
        for index, chunk in enumerate(scripted):
            if index == fail_at:
                raise BackendError(status, "scripted failure", param="messages")
            yield json.loads(json.dumps(chunk))
        if fail_at == len(scripted):
            raise BackendError(status, "scripted failure", param="messages")
        embeddings = call.api == "embeddings"
        yield usage_chunk("x", call.model_id, 1, 3, 0 if embeddings else 2,
                          cached_tokens=None if embeddings else cached_tokens)

    return MockBackend(handler)


def sdk_http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


def openai_client(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://node/v1", api_key=TOKEN, max_retries=0, http_client=sdk_http(app))


def anthropic_client(app: Any, **auth: str) -> anthropic.AsyncAnthropic:
    import httpx2  # the anthropic SDK's own fork of httpx: it refuses httpx clients

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://node")
    return anthropic.AsyncAnthropic(base_url="http://node", max_retries=0, http_client=http,
                                    **(auth or {"api_key": TOKEN}))


TEXT = {"chat": text_chunks("Hel", "lo"), "completions": [completion(" upon"), completion(" a", "length")],
        "embeddings": [EMBEDDING]}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


async def test_completions_and_embeddings_through_the_openai_sdk() -> None:
    slots = Slots(1)
    backend = api_backend(TEXT)
    sdk = openai_client(create_app(backend, slots, [MODEL], TOKEN))
    done = await sdk.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.choices[0].text == " upon a"
    assert done.choices[0].finish_reason == "length" and done.usage is not None and done.usage.total_tokens == 5
    last = backend.calls[-1]
    assert (last.api, last.body) == ("completions", {"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True})
    chunks = [c async for c in await sdk.completions.create(model=MODEL, prompt="Once", stream=True)]
    assert [c.choices[0].text for c in chunks] == [" upon", " a"] and backend.calls[-1].body["max_tokens"] == 16
    for encoding in ("base64", "float"):  # the SDK asks for base64 unless told, and decodes it
        kwargs: dict[str, Any] = {"encoding_format": encoding} if encoding == "float" else {}
        embedded = await sdk.embeddings.create(model=MODEL, input="hello", **kwargs)
        assert embedded.data[0].embedding == [0.5, -0.25, 1.0] and embedded.usage.prompt_tokens == 3
    last = backend.calls[-1]
    assert (last.api, last.body) == ("embeddings", {"model": MODEL, "input": "hello"})
    await idle(slots)


async def test_responses_through_the_openai_sdk() -> None:
    slots = Slots(1)
    backend = api_backend(TEXT)
    sdk = openai_client(create_app(backend, slots, [MODEL], TOKEN))
    response = await sdk.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=8)
    assert response.output_text == "Hello" and response.id.startswith("resp_") and response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 2
    last = backend.calls[-1]
    api, body = last.api, last.body
    assert api == "chat" and body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["max_tokens"] == 8 and body["stream"] is True
    events = [e async for e in await sdk.responses.create(model=MODEL, input="Hi", stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    async with sdk.responses.stream(model=MODEL, input="Hi") as stream:
        final = await stream.get_final_response()
    assert final.output_text == "Hello"
    await idle(slots)


async def test_every_api_says_the_backends_cached_tokens() -> None:
    slots = Slots(1)
    app = create_app(api_backend(TEXT, cached_tokens=2), slots, [MODEL], TOKEN)
    sdk = openai_client(app)
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert (chat.usage.prompt_tokens, chat.usage.prompt_tokens_details.cached_tokens) == (3, 2)
    streamed = [c async for c in await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, stream_options={"include_usage": True})]
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 2
    done = await sdk.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 2
    response = await sdk.responses.create(model=MODEL, input="Hi")
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 2
    message = await anthropic_client(app).messages.create(model=MODEL, max_tokens=8,
                                                          messages=[{"role": "user", "content": "Hi"}])
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (1, 2)
    embedded = await sdk.embeddings.create(model=MODEL, input="hello")
    assert "prompt_tokens_details" not in embedded.usage.model_dump(exclude_unset=True)
    await idle(slots)


async def test_a_backend_that_does_not_know_says_none_were_cached() -> None:
    slots = Slots(1)
    sdk = openai_client(create_app(api_backend(TEXT), slots, [MODEL], TOKEN))
    chat = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    await idle(slots)


async def test_a_responses_tool_call_and_its_round_trip() -> None:
    slots = Slots(1)
    backend = api_backend({"chat": tool_chunks()})
    sdk = openai_client(create_app(backend, slots, [MODEL], TOKEN))
    response = await sdk.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                          tool_choice="required")
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    assert backend.calls[-1].body["tool_choice"] == "required"
    await sdk.responses.create(model=MODEL, tools=[WEATHER], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}])
    messages = backend.calls[-1].body["messages"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id and messages[2] == {
        "role": "tool", "tool_call_id": call.call_id, "content": "18C"}
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.responses.create(model=MODEL, input="Hi", store=True)
    assert caught.value.body["param"] == "store"  # type: ignore[index]
    await idle(slots)


async def test_messages_through_the_anthropic_sdk() -> None:
    slots = Slots(1)
    backend = api_backend({"chat": text_chunks("Hel", "lo")})
    app = create_app(backend, slots, [MODEL], TOKEN)
    for auth in ({"api_key": TOKEN}, {"auth_token": TOKEN}):  # x-api-key, or Authorization: Bearer
        sdk = anthropic_client(app, **auth)
        message = await sdk.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                                            messages=[{"role": "user", "content": "Hi"}])
        assert message.content[0].type == "text" and message.content[0].text == "Hello"
        assert message.stop_reason == "end_turn" and message.usage.input_tokens == 3
    async with sdk.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello" and final.usage.output_tokens == 2 and final.usage.input_tokens == 3
    assert backend.calls[-1].body["max_tokens"] == 8
    await idle(slots)


async def test_a_forced_tool_use_through_the_anthropic_sdk() -> None:
    backend = api_backend({"chat": tool_chunks()})
    sdk = anthropic_client(create_app(backend, Slots(1), [MODEL], TOKEN))
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
    message = await sdk.messages.create(model=MODEL, max_tokens=32, tools=tools,  # type: ignore[arg-type]
                                        tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Hi"}])
    assert message.stop_reason == "tool_use" and message.content[0].type == "tool_use"
    assert message.content[0].input == {"city": "Paris"}
    async with sdk.messages.stream(model=MODEL, max_tokens=32, tools=tools,  # type: ignore[arg-type]
                                   messages=[{"role": "user", "content": "Hi"}]) as stream:
        final = await stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}


async def test_anthropic_errors_are_anthropic_envelopes() -> None:
    backend = api_backend({"chat": text_chunks("Hi")})
    app = create_app(backend, Slots(1), [MODEL], TOKEN)
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic_client(app, api_key="dk-local-wrong").messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.NotFoundError):
        await anthropic_client(app).messages.create(model="other", max_tokens=8,
                                                    messages=[{"role": "user", "content": "Hi"}])
    async with client(app) as http:
        for headers, body, status, kind in (
                ({"x-api-key": TOKEN}, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, 400,
                 "invalid_request_error"),
                ({"x-api-key": TOKEN}, {"model": MODEL, "max_tokens": 8, "messages": []}, 400,
                 "invalid_request_error"),
                ({}, {}, 401, "authentication_error")):
            response = await http.post("/v1/messages", headers=headers, json=body)
            assert response.status_code == status
            assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
        too_large = await http.post("/v1/messages", headers={"x-api-key": TOKEN},
                                    content=b'{"model": "' + b"x" * (8 * 1024 * 1024) + b'"}')
        assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
        # x-api-key is Anthropic's header: the OpenAI routes still want the bearer token
        other = await http.post("/v1/responses", headers={"x-api-key": TOKEN}, json={"model": MODEL, "input": "Hi"})
        assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
    assert len(backend.calls) == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": MODEL, "input": "Hi", "stream": True}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                      "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True}),
])
async def test_a_failure_before_the_first_content_is_a_real_http_error(path: str, body: dict[str, Any]) -> None:
    slots = Slots(1)
    app = create_app(api_backend(TEXT, fail_at=0, status=400), slots, [MODEL], TOKEN)
    async with client(app) as http:
        response = await http.post(path, headers=AUTH, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"] == "scripted failure" and error["type"] == "invalid_request_error"
        if path != "/v1/messages":
            assert error["param"] == "messages"
    await idle(slots)


async def test_a_failure_after_the_first_content_ends_each_stream_in_its_api() -> None:
    slots = Slots(1)
    app = create_app(api_backend(TEXT, fail_at=2), slots, [MODEL], TOKEN)
    async with client(app) as http:
        responses = await http.post("/v1/responses", headers=AUTH, json={"model": MODEL, "input": "Hi", "stream": True})
        names = [name for name, _ in sse_events(responses.content)]
        assert names[:2] == ["response.created", "response.in_progress"] and names[-2:] == ["error", "response.failed"]
        await idle(slots)
        messages = await http.post("/v1/messages", headers=AUTH, json={
            "model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
        name, data = sse_events(messages.content)[-1]
        assert name == "error" and data["error"]["type"] == "api_error"
        await idle(slots)
        completions = await http.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hi",
                                                                             "stream": True})
        events = sse_events(completions.content)
        assert "error" in events[-1][1] and "[DONE]" not in [data for _, data in events]
    await idle(slots)


async def test_translation_errors_never_take_a_slot() -> None:
    slots = Slots(1)
    backend = api_backend(TEXT)
    async with client(create_app(backend, slots, [MODEL], TOKEN)) as http:
        for path, body, param in (
                ("/v1/responses", {"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"},
                 "previous_response_id"),
                ("/v1/responses", {"model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
                ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 33}, "prompt"),
                ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 8}, "dimensions"),
                ("/v1/embeddings", {"model": "other", "input": "x"}, "model")):
            response = await http.post(path, headers=AUTH, json=body)
            assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, path
    assert backend.calls == [] and slots.active == 0
