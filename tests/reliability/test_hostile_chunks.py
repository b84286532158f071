"""Hostile chunks and frames against a real coordinator, from raw providers (issue 19, rows 2, 4, 6):

- one sealed array of 800,000 `{}` (≈3 MB, under the frame limit) for the provider's own free
  Self-Route request is a chunk that does not open: the provider is distrusted, and /health keeps
  answering; a large but legal flood for a public request is relayed whole while /health answers;
- embeddings answered in several chunks (one per input, out of order) are one answer, in index
  order; a frame over the limit fails its request with a named error (never 200 with `data: []`);
- a chunk of a shape no presenter reads is `untrusted_chunk` (502, the envelope, the request id),
  never a plain-text 500, and the provider is distrusted.

/health latencies are measured and printed, never asserted on.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import pytest

from darkbloom.wire.chunk_arrays import MAX_CHUNKS_PER_FRAME
from darkbloom.wire.protocol import MAX_FRAME_BYTES, SOCKET_MESSAGE_LIMIT, TrustStatus
from tests.support.accounts import Account, balance, create_account, device_token
from tests.support.hostile import (
    HealthWatch, balance_settles_at, new_model, registered, send_plaintext, sse_data, usage_ids)
from tests.support.processes import Coordinator, sqlite_coordinator

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    with sqlite_coordinator(tmp_path_factory.mktemp("hostile-chunks"), "--first-content-timeout", "10") as process:
        yield process


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    return create_account(coord, credit_micro_usd=10_000_000)


def _content(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_array_of_800000_chunks_is_refused_and_the_coordinator_keeps_answering(
        coord: Coordinator, stream: bool) -> None:
    owner = create_account(coord)
    model = "own-" + new_model(coord)
    raw = await registered(coord, model, auth_token=device_token(coord, owner))
    flood = b"[" + b",".join([b"{}"] * 800_000) + b"]"
    watch = await HealthWatch(coord).start()
    await watch.answered(3)
    async with httpx.AsyncClient(timeout=60) as http:
        request = asyncio.create_task(http.post(
            coord.api_url + "/chat/completions", json={"model": model, "stream": stream, "messages": HELLO},
            headers={**owner.headers(), "X-Darkbloom-Route": "self"}))
        inference, _ = await raw.next_request()
        await send_plaintext(raw, inference, flood)
        await watch.answered(3)  # answered while the frame is opened and refused
        await raw.send_complete(inference, 1, 1)
        response = await request
        status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
    answers = await watch.stop(f"800,000 chunks, stream={stream}")
    # the owner's only machine can no longer serve privately: Self-Route's named error says why
    assert response.status_code == 503 and response.json()["error"]["type"] == "model_routing_blocked"
    assert "integrity check" in response.json()["error"]["message"]
    assert len(response.content) < 10_000  # not 101 MB of SSE
    assert status.trust_level == "untrusted"
    assert all(code == 200 for code, _ in answers)
    await raw.close()


async def test_a_large_but_legal_flood_is_relayed_whole_while_health_answers(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    frames, per_frame = 25, MAX_CHUNKS_PER_FRAME
    watch = await HealthWatch(coord).start()
    async with httpx.AsyncClient(timeout=120) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "stream": True, "messages": HELLO}))
        inference, _ = await raw.next_request()
        for _ in range(frames):
            await send_plaintext(raw, inference, json.dumps([_content("x")] * per_frame).encode())
        await watch.answered(3)  # while the request is still open: no completion sent yet
        assert not request.done()
        await raw.send_complete(inference, 1, 1)
        response = await request
    answers = await watch.stop(f"{frames} frames of {per_frame} chunks")
    assert response.status_code == 200
    chunks = [event for event in sse_data(response.text) if event != "[DONE]"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "x" * (frames * per_frame)
    assert all(code == 200 for code, _ in answers)
    assert raw.trust_statuses == []
    await raw.close()


def _vector(index: int) -> list[float]:
    return [index + 0.5, -index - 0.25, 1.0]


async def test_embeddings_in_several_chunks_are_one_answer_in_index_order(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model, ("embeddings",))
    inputs = [f"text {i}" for i in range(5)]
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/embeddings", headers=account.headers(),
                                                json={"model": model, "input": inputs}))
        inference, body = await raw.next_request()
        assert inference.api == "embeddings" and body["input"] == inputs
        for index in (3, 0, 4, 1, 2):  # one chunk per input, as they finish
            await raw.send_data(inference, {"object": "list", "model": "m", "data": [
                {"object": "embedding", "index": index, "embedding": _vector(index)}]})
        await raw.send_complete(inference, 10, 0)
        response = await request
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == [0, 1, 2, 3, 4]
    assert [item["embedding"] for item in data] == [_vector(i) for i in range(5)]
    await raw.close()


@pytest.mark.parametrize("size", [MAX_FRAME_BYTES + 1024, SOCKET_MESSAGE_LIMIT + 1024])
async def test_a_frame_over_the_limit_fails_its_request_by_name(
        coord: Coordinator, account: Account, size: int) -> None:
    """Over the protocol's limit the frame is refused alone; over the socket's it closes the socket.
    Either way its request fails by name, uncharged — never 200 with `data: []`."""
    model = new_model(coord)
    raw = await registered(coord, model, ("embeddings",))
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/embeddings", headers=account.headers(),
                                                json={"model": model, "input": ["a", "b"]}))
        inference, _ = await raw.next_request()
        assert raw.ws is not None
        await raw.ws.send('{"type":"inference_response_chunk","request_id":"%s","encrypted_data":'
                          '{"ephemeral_public_key":"k","ciphertext":"%s"}}' % (inference.request_id, "A" * size))
        if size < SOCKET_MESSAGE_LIMIT:
            await raw.send_complete(inference, 2, 0)  # … and then claims to have finished
        response = await request
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("provider_error", "frame_too_large")
    await balance_settles_at(coord, account, before)
    assert response.headers["x-request-id"] not in usage_ids(coord, account)
    await raw.close()


MALFORMED = [
    (True, "/chat/completions", (), {"choices": 5}),
    (True, "/chat/completions", (), {"choices": [1, 2]}),
    (True, "/chat/completions", (), {"choices": [{"delta": "s"}]}),
    (False, "/chat/completions", (), {"choices": [{"index": 0, "delta": {"tool_calls": 7}}]}),
    (False, "/chat/completions", (), {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": [1], "function": {"name": "f", "arguments": "{}"}}]}}]}),
    (False, "/chat/completions", (), {"choices": [{"index": 0, "delta": {"content": 12345}}]}),
    (False, "/embeddings", ("embeddings",), {"object": "list", "data": [{"index": "a", "embedding": [0.1]}]}),
]


@pytest.mark.parametrize("stream,path,capabilities,chunk", MALFORMED, ids=[json.dumps(c[3]) for c in MALFORMED])
async def test_a_chunk_of_the_wrong_shape_is_an_untrusted_chunk_never_a_500(
        coord: Coordinator, account: Account, stream: bool, path: str, capabilities: tuple[str, ...],
        chunk: dict[str, Any]) -> None:
    model = new_model(coord)
    raw = await registered(coord, model, capabilities)
    before = balance(coord, account)
    body = {"model": model, "input": "x"} if path == "/embeddings" else {"model": model, "messages": HELLO,
                                                                         "stream": stream}
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + path, headers=account.headers(), json=body))
        inference, _ = await raw.next_request()
        await raw.send_data(inference, chunk)
        await raw.send_complete(inference, 1, 1)
        response = await request
        status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["type"] == "untrusted_chunk"
    assert response.headers["x-request-id"] == inference.request_id
    assert status.trust_level == "untrusted"
    await balance_settles_at(coord, account, before)
    await raw.close()
