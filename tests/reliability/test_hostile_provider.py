"""Hostile providers (a raw WebSocket client speaking the real protocol) against a real coordinator:
a provider that goes quiet after its first chunk, one that never finishes, and providers whose
own error text and statuses try to reach the consumer (issue 12, defects 3 and 10).

The coordinator runs with short deadlines: ``--idle-timeout 1`` (silence allowed between chunks
once content has started) and ``--request-timeout 4`` (the whole request).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from darkbloom.wire.crypto import Sealer, public_key_from_b64
from darkbloom.wire.protocol import MAX_REQUEST_FRAME_BYTES, Cancel, InferenceResponseChunk, TrustStatus, dump
from tests.support.accounts import Account, balance, create_account, device_token
from tests.support.hostile import balance_settles_at, new_model, registered, sse_data
from tests.support.processes import Coordinator, sqlite_coordinator
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

CREDIT = 10_000_000
SECRET = "PROVIDER-SECRET-TEXT-" + secrets.token_hex(4)


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    with sqlite_coordinator(tmp_path_factory.mktemp("hostile"), "--idle-timeout", "1", "--request-timeout", "4",
                            "--first-content-timeout", "5") as process:
        yield process


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    return create_account(coord, credit_micro_usd=CREDIT)


async def test_a_provider_silent_after_first_content_is_stopped_at_the_idle_deadline(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_chunk(inference, "first words")  # … and then nothing
        cancel = await asyncio.wait_for(raw.recv_until(Cancel), 10)
        response = await request
    assert cancel.request_id == inference.request_id
    events = sse_data(response.text)
    assert events[0]["choices"][0]["delta"]["content"] == "first words"
    assert events[-1]["error"]["code"] == "provider_timeout" and "[DONE]" not in events
    await balance_settles_at(coord, account, before)  # the reservation went back; nothing charged
    # the slot was freed: the next request reaches the provider again
    async with httpx.AsyncClient(timeout=30) as http:
        again = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                              json={"model": model, "messages": [{"role": "user", "content": "x"}]}))
        inference, _ = await asyncio.wait_for(raw.next_request(), 10)
        await raw.answer(inference, "ok")
        assert (await again).status_code == 200
    await raw.close()


async def test_a_non_streaming_request_gets_a_504_at_the_idle_deadline(coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_chunk(inference, "partial")
        response = await request
    assert response.status_code == 504 and response.json()["error"]["type"] == "provider_timeout"
    await raw.close()


async def test_a_provider_that_never_finishes_is_stopped_at_the_request_deadline(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        while not request.done() and time.monotonic() - started < 20:  # a chunk every 0.3 s, forever
            await raw.send_chunk(inference, ".")
            await asyncio.sleep(0.3)
        response = await request
    events = sse_data(response.text)
    assert events[-1]["error"]["code"] == "provider_timeout"
    assert "request deadline" in events[-1]["error"]["message"]
    await raw.close()


@pytest.mark.parametrize("status,expected_status,expected_type", [
    (401, 502, "provider_error"), (403, 502, "provider_error"), (500, 502, "provider_error"),
    (400, 400, "invalid_request_error"), (422, 400, "invalid_request_error"),
])
async def test_the_providers_own_error_text_never_reaches_the_consumer(
        coord: Coordinator, account: Account, status: int, expected_status: int, expected_type: str) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_error(inference, status, SECRET)
        response = await request
    assert response.status_code == expected_status
    assert response.json()["error"]["type"] == expected_type
    assert SECRET not in response.text
    await balance_settles_at(coord, account, before)
    await raw.close()


async def test_a_request_the_provider_refuses_as_invalid_is_not_retried_elsewhere(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    first, second = await registered(coord, model), await registered(coord, model)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        waits = {asyncio.create_task(first.next_request()), asyncio.create_task(second.next_request())}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        inference, _ = done.pop().result()
        serving, other = (first, second) if inference.request_id in first.seen_requests else (second, first)
        await serving.send_error(inference, 400, SECRET)
        response = await request
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # a retry is dispatched before the answer: it would reach the other provider ahead of this barrier
    await other.round_trip()
    assert response.status_code == 400
    assert inference.request_id not in other.seen_requests
    await first.close()
    await second.close()


@pytest.mark.parametrize("prompt_tokens,completion_tokens", [(2**63, 1), (2**31, 1), (3, 10_000)])
async def test_impossible_usage_fails_the_request_unbilled_and_distrusts_the_provider(
        coord: Coordinator, account: Account, prompt_tokens: int, completion_tokens: int) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "max_tokens": 16,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_chunk(inference, "words")
        await raw.send_complete(inference, prompt_tokens, completion_tokens)
        response = await request
        status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
    assert response.status_code == 502 and response.json()["error"]["type"] == "untrusted_usage"
    assert status.trust_level == "untrusted"
    await balance_settles_at(coord, account, before)
    usage = httpx.get(coord.api_url + "/payments/usage", headers=account.headers()).json()["data"]
    assert inference.request_id not in [row["request_id"] for row in usage]
    await raw.close()


# forged, replayed and cross-request chunks: none opens for the request it claims; each fails
# that request (502 untrusted_chunk, nothing charged) and marks the provider untrusted at once


async def _chunk_sealed_to(raw: RawProvider, request_id: str, ephemeral_key: str, text: str) -> None:
    assert raw.ws is not None
    sealer = Sealer(public_key_from_b64(ephemeral_key))
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    await raw.ws.send(dump(InferenceResponseChunk(request_id=request_id,
                                                  encrypted_data=sealer.seal(json.dumps(chunk).encode()))))


@pytest.mark.parametrize("forgery", ["wrong_key", "cross_request", "replayed", "plaintext"])
async def test_a_chunk_that_does_not_open_fails_the_request_and_distrusts_the_provider(
        coord: Coordinator, account: Account, forgery: str) -> None:
    model = new_model(coord)
    raw = RawProvider(coord.base_url, models=(model,), max_concurrency=2)
    await raw.register()
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    def post(http: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                             json=body))

    async with httpx.AsyncClient(timeout=30) as http:
        earlier = None
        if forgery == "replayed":  # a chunk sealed for an earlier, finished request of this provider
            finished = post(http)
            earlier, _ = await raw.next_request()
            await raw.answer(earlier, "earlier answer")
            assert (await finished).status_code == 200
        before = balance(coord, account)
        victim = post(http)
        inference, _ = await raw.next_request()
        neighbour = None
        if forgery == "wrong_key":
            await _chunk_sealed_to(raw, inference.request_id, raw.identity.public_key_b64, "forged")
        elif forgery == "cross_request":  # sealed to a concurrent request's reply key
            neighbour = post(http)
            other, _ = await raw.next_request()
            await _chunk_sealed_to(raw, inference.request_id, other.encrypted_body.ephemeral_public_key, "x")
        elif forgery == "replayed":
            assert earlier is not None
            await _chunk_sealed_to(raw, inference.request_id, earlier.encrypted_body.ephemeral_public_key, "again")
        else:
            assert raw.ws is not None
            await raw.ws.send(json.dumps({"type": "inference_response_chunk", "request_id": inference.request_id,
                                          "encrypted_data": {"ephemeral_public_key": raw.identity.public_key_b64,
                                                             "ciphertext": "aGVsbG8gd29ybGQ="}}))
        response = await victim
        status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
        if neighbour is not None:
            neighbour.cancel()
    assert response.status_code == 502 and response.json()["error"]["type"] == "untrusted_chunk"
    assert status.trust_level == "untrusted"
    await balance_settles_at(coord, account, before)
    await raw.close()


def _content_chunk(text: str) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_chunks_sent_together_in_one_frame_are_relayed_in_order(coord: Coordinator, account: Account,
                                                                      stream: bool) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    assert raw.registered is not None and raw.registered["chunk_arrays"] is True  # it says it opens arrays
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(
            coord.api_url + "/chat/completions", headers=account.headers(),
            json={"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_data(inference, [_content_chunk("one "), _content_chunk("two ")])
        await raw.send_data(inference, [_content_chunk("three")])
        await raw.send_complete(inference, 3, 3)
        response = await request
    assert response.status_code == 200
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text == "one two three"
    await raw.close()


@pytest.mark.parametrize("payload", [[], [{"choices": []}, "text"]])
async def test_an_array_that_is_not_all_chunks_fails_the_request_and_distrusts_the_provider(
        coord: Coordinator, account: Account, payload: list[Any]) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_data(inference, payload)
        response = await request
        status = await asyncio.wait_for(raw.recv_until(TrustStatus), 10)
    assert response.status_code == 502 and response.json()["error"]["type"] == "untrusted_chunk"
    assert status.trust_level == "untrusted"
    await balance_settles_at(coord, account, before)
    await raw.close()


async def test_chunks_for_unknown_requests_are_ignored(coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    await _chunk_sealed_to(raw, "chatcmpl-nobody", raw.identity.public_key_b64, "noise")
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.answer(inference, "still trusted")
        response = await request
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "still trusted"
    await raw.close()


# bodies up to the body limit reach the node, whatever their size once sealed (defect 1)

BIG_PROMPT = "x" * 6_800_000  # under the 8 MiB body limit; its sealed frame is past 8 MiB


async def test_a_request_too_large_for_a_providers_frame_limit_fails_alone(coord: Coordinator,
                                                                          account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)  # advertises no limit: the protocol's 8 MiB
    async with httpx.AsyncClient(timeout=60) as http:
        big = await http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                              json={"model": model, "messages": [{"role": "user", "content": BIG_PROMPT}]})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        assert raw.seen_requests == set()  # never sent, so its socket stayed open …
        small = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                              json={"model": model, "messages": [{"role": "user", "content": "x"}]}))
        inference, _ = await asyncio.wait_for(raw.next_request(), 10)
        await raw.answer(inference, "still here")  # … and it serves the next request
        assert (await small).status_code == 200
    await raw.close()


async def test_a_body_near_the_limit_reaches_a_node_of_this_release(coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = RawProvider(coord.base_url, models=(model,), max_request_frame_bytes=MAX_REQUEST_FRAME_BYTES)
    await raw.register()
    async with httpx.AsyncClient(timeout=60) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": BIG_PROMPT}]}))
        inference, body = await asyncio.wait_for(raw.next_request(), 30)
        assert body["messages"][0]["content"] == BIG_PROMPT
        await raw.answer(inference, "read it all")
        response = await request
    assert response.status_code == 200
    await raw.close()


async def test_a_malformed_completion_ends_at_the_idle_deadline(coord: Coordinator, account: Account) -> None:
    """A malformed `inference_complete` is a bad frame (an error frame back); the request it claimed
    to finish does not hang: it ends at the idle deadline, unbilled."""
    model = new_model(coord)
    raw = await registered(coord, model)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model, "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.send_chunk(inference, "words")
        assert raw.ws is not None
        await raw.ws.send(json.dumps({"type": "inference_complete", "request_id": inference.request_id,
                                      "usage": {"prompt_tokens": -5, "completion_tokens": "many"}}))
        response = await request
    assert sse_data(response.text)[-1]["error"]["code"] == "provider_timeout"
    await balance_settles_at(coord, account, before)
    await raw.close()


async def test_a_node_advertising_an_over_long_model_id_is_refused_and_breaks_no_view(coord: Coordinator) -> None:
    owner = create_account(coord)
    raw = RawProvider(coord.base_url, auth_token=device_token(coord, owner), models=("ok-model",))
    frame = json.loads(dump(raw.register_frame()))
    frame["models"].insert(0, {"id": "m" * 300})  # past MAX_MODEL_ID (docs/protocol.md "Bounds")
    ws = await raw.connect()
    await ws.send(json.dumps(frame))
    error = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert error["type"] == "error" and "register.models.0.id" in error["message"]
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 10)
    for path, headers in (("/me/self-route-models", {}), ("/models", {"X-Darkbloom-Route": "self"}),
                          ("/me/providers", {})):
        response = httpx.get(coord.api_url + path, headers={**owner.headers(), **headers})
        assert response.status_code == 200, (path, response.text)
    assert httpx.get(coord.api_url + "/me/self-route-models", headers=owner.headers()).json()["models"] == []


async def test_a_second_register_is_a_bad_frame_and_changes_nothing(coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    assert raw.ws is not None
    forged = raw.register_frame().model_copy(update={"models": raw.register_frame().models * 2,
                                                     "max_concurrency": 64})
    await raw.ws.send(dump(forged))
    error = json.loads(await raw.ws.recv())
    assert error["type"] == "error" and error["code"] == "already_registered"
    async with httpx.AsyncClient(timeout=30) as http:  # still registered as first said, still serving
        request = asyncio.create_task(http.post(coord.api_url + "/chat/completions", headers=account.headers(),
                                                json={"model": model,
                                                      "messages": [{"role": "user", "content": "hi"}]}))
        inference, _ = await raw.next_request()
        await raw.answer(inference, "ok")
        assert (await request).status_code == 200
    await raw.close()
