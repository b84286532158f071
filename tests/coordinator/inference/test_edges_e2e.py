"""The APIs beyond chat through a real coordinator, with raw providers speaking the real protocol:
capability routing and its named errors, what a node receives per API, the presenters' answers, a
provider's param/code reaching the client (and nothing else of its), Anthropic's key header and
envelope, and the money of an embeddings request."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import struct
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.support.accounts import Account, balance, create_account
from tests.support.processes import Coordinator, sqlite_coordinator
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

CREDIT = 10_000_000
ALL = ("tools", "structured_output", "logprobs", "completions", "embeddings")
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    with sqlite_coordinator(tmp_path_factory.mktemp("edges")) as process:
        yield process


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    return create_account(coord, credit_micro_usd=CREDIT)


def _new_model(coord: Coordinator) -> str:
    model = "edge-" + secrets.token_hex(4)
    catalog = httpx.get(coord.api_url + "/admin/catalog", headers=coord.admin()).json()
    catalog["models"].append({"id": model, "input_price": 1_000, "output_price": 1_000})
    httpx.put(coord.api_url + "/admin/catalog", json=catalog, headers=coord.admin()).raise_for_status()
    return model


async def _provider(coord: Coordinator, model: str, capabilities: tuple[str, ...] = ()) -> RawProvider:
    raw = RawProvider(coord.base_url, models=(model,), capabilities=capabilities)
    await raw.register()
    return raw


async def _usage_row(coord: Coordinator, account: Account, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(coord.api_url + "/payments/usage", headers=account.headers()).json()["data"]
        found = [row for row in rows if row["request_id"] == request_id]
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no usage row for {request_id}")


async def _post(coord: Coordinator, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(coord.api_url + path, json=body, headers=headers)


@pytest.mark.parametrize("path, body, param", [
    ("/embeddings", {"input": "hello"}, "model"),
    ("/completions", {"prompt": "hello"}, "model"),
    ("/chat/completions", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/chat/completions", {"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format"),
    ("/chat/completions", {"messages": HELLO, "logprobs": True}, "logprobs"),
])
async def test_a_request_no_provider_can_shape_is_a_named_400_not_a_retryable_503(
        coord: Coordinator, account: Account, path: str, body: dict[str, Any], param: str) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model)  # plain chat only
    response = await _post(coord, path, {"model": model, **body}, account.headers())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "model_capability_unsupported" and error["param"] == param
    assert response.headers["x-should-retry"] == "false"
    assert not raw.seen_requests
    await raw.close()


async def test_capability_routing_skips_the_provider_without_it(coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    plain = await _provider(coord, model)
    capable = await _provider(coord, model, ALL)
    for _ in range(3):  # whichever the scheduler would pick, the embeddings go to the capable one
        request = asyncio.create_task(_post(coord, "/embeddings", {"model": model, "input": "x"}, account.headers()))
        frame, body = await asyncio.wait_for(capable.next_request(), 10)
        assert frame.api == "embeddings"
        await capable.send_data(frame, {"object": "list", "data": [{"object": "embedding", "index": 0,
                                                                    "embedding": [0.5, -1.0]}]})
        await capable.send_complete(frame, 3, 0)
        assert (await request).status_code == 200
    assert not plain.seen_requests
    await plain.close()
    await capable.close()


async def test_embeddings_reach_the_node_as_floats_and_the_client_as_it_asked(
        coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model, ALL)
    model_price = 1_000_000  # µUSD per million tokens: 4 tokens cost 4 µUSD
    catalog = httpx.get(coord.api_url + "/admin/catalog", headers=coord.admin()).json()
    for entry in catalog["models"]:
        if entry["id"] == model:
            entry["input_price"] = model_price
    httpx.put(coord.api_url + "/admin/catalog", json=catalog, headers=coord.admin()).raise_for_status()
    before = balance(coord, account)
    request = asyncio.create_task(_post(coord, "/embeddings", {"model": model, "input": ["a", "b"],
                                                               "encoding_format": "base64"}, account.headers()))
    frame, body = await asyncio.wait_for(raw.next_request(), 10)
    assert body == {"model": model, "input": ["a", "b"]}
    vectors = [[0.25, -2.0, 1.5], [1.0, 0.0, -0.5]]
    await raw.send_data(frame, {"object": "list", "data": [
        {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]})
    await raw.send_complete(frame, 4, 0)
    response = await request
    assert response.status_code == 200, response.text
    answer = response.json()
    decoded = [list(struct.unpack("<3f", base64.b64decode(item["embedding"]))) for item in answer["data"]]
    assert decoded == vectors and answer["model"] == model
    assert answer["usage"]["prompt_tokens"] == 4
    row = await _usage_row(coord, account, response.headers["x-request-id"])
    assert row["prompt_tokens"] == 4 and row["completion_tokens"] == 0
    assert balance(coord, account) == before - row["cost_micro_usd"]  # the reservation came back, the rest paid
    await raw.close()


async def test_legacy_completions_stream_text_completion_chunks(coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model, ALL)
    request = asyncio.create_task(_post(coord, "/completions", {"model": model, "prompt": "Once", "stream": True},
                                        account.headers()))
    frame, body = await asyncio.wait_for(raw.next_request(), 10)
    assert frame.api == "completions" and body["prompt"] == "Once" and body["max_tokens"] == 16
    await raw.send_data(frame, {"object": "text_completion", "choices": [
        {"index": 0, "text": " upon", "logprobs": None, "finish_reason": None}]})
    await raw.send_data(frame, {"object": "text_completion", "choices": [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})
    await raw.send_complete(frame, 2, 2)
    response = await request
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == model for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " upon"
    assert not any("usage" in c and not c["choices"] for c in chunks)  # no usage chunk unless asked
    await raw.close()


async def test_a_providers_param_and_context_code_reach_the_client_but_not_its_words(
        coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model, ALL)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    cases = [(dict(param="messages", code="context_length_exceeded"), "context_length_exceeded", "messages"),
             (dict(param="tools[0].function.parameters"), "invalid_request_error", "tools[0].function.parameters"),
             (dict(param="free text from the provider!"), "invalid_request_error", None),
             (dict(code="made_up_code"), "invalid_request_error", None)]
    for sent, code, param in cases:
        request = asyncio.create_task(_post(coord, "/chat/completions",
                                            {"model": model, "messages": HELLO, "tools": tools},
                                            account.headers()))
        frame, _ = await asyncio.wait_for(raw.next_request(), 10)
        await raw.send_error(frame, 400, "PROVIDER WORDS", **sent)
        response = await request
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (code, param), sent
        assert "PROVIDER WORDS" not in response.text
    await raw.close()


async def test_anthropic_messages_take_x_api_key_and_answer_in_anthropics_envelope(
        coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model, ALL)
    body = {"model": model, "max_tokens": 8, "messages": HELLO}
    refused = await _post(coord, "/messages", body, {"x-api-key": "dk-wrong"})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
    missing = await _post(coord, "/messages", {"model": model, "messages": HELLO}, {"x-api-key": account.api_key})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    request = asyncio.create_task(_post(coord, "/messages", body, {"x-api-key": account.api_key}))
    frame, forwarded = await asyncio.wait_for(raw.next_request(), 10)
    assert frame.api == "chat" and forwarded["messages"] == HELLO and forwarded["max_tokens"] == 8
    await raw.answer(frame, "hello there")
    response = await request
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["type"] == "message" and message["content"] == [{"type": "text", "text": "hello there"}]
    assert message["usage"]["input_tokens"] == 3 and message["usage"]["output_tokens"] == 1
    # x-api-key is the Messages API's alone
    other = await _post(coord, "/chat/completions", {"model": model, "messages": HELLO}, {"x-api-key": account.api_key})
    assert other.status_code == 401 and "error" in other.json() and "type" in other.json()["error"]
    await raw.close()


async def test_a_list_of_prompts_is_one_request_with_a_choice_per_prompt(coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    without = await _provider(coord, model, ALL)
    body = {"model": model, "prompt": ["One", "Two", "Three"], "max_tokens": 5}
    refused = await _post(coord, "/completions", body, account.headers())
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_capability_unsupported"
    assert refused.json()["error"]["param"] == "prompt" and not without.seen_requests
    await without.close()
    raw = await _provider(coord, model, (*ALL, "completion_batches"))
    too_many = await _post(coord, "/completions", {**body, "prompt": ["x"] * 33}, account.headers())
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_prompts"
    before = balance(coord, account)
    for stream in (False, True):
        request = asyncio.create_task(_post(coord, "/completions", {**body, "stream": stream}, account.headers()))
        frame, forwarded = await asyncio.wait_for(raw.next_request(), 10)
        assert frame.api == "completions" and forwarded["prompt"] == body["prompt"] and forwarded["max_tokens"] == 5
        for index in (0, 1, 2):
            await raw.send_data(frame, {"object": "text_completion", "choices": [
                {"index": index, "text": f" {index}", "logprobs": None, "finish_reason": "length"}]})
        await raw.send_complete(frame, 9, 15)  # every prompt's max_tokens: the batch's output bound
        response = await request
        assert response.status_code == 200, response.text
        row = await _usage_row(coord, account, response.headers["x-request-id"])
        assert (row["prompt_tokens"], row["completion_tokens"]) == (9, 15) and row["cost_micro_usd"] > 0
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
                (0, " 0"), (1, " 1"), (2, " 2")]
        else:
            answer = response.json()
            assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, " 0"), (1, " 1"), (2, " 2")]
            assert answer["usage"]["cost_micro_usd"] == row["cost_micro_usd"] == int(
                response.headers["x-darkbloom-cost-micro-usd"])
        before -= row["cost_micro_usd"]
        assert balance(coord, account) == before
    await raw.close()


async def test_count_tokens_is_the_context_estimate_unbilled_and_in_anthropics_envelope(
        coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    before = balance(coord, account)
    body = {"model": model, "system": "Be brief.", "messages": HELLO}
    counted = await _post(coord, "/messages/count_tokens", body, {"x-api-key": account.api_key})
    assert counted.status_code == 200, counted.text
    chat = {"messages": [{"role": "system", "content": "Be brief."}, *HELLO]}
    expected = -(-(len(json.dumps(chat, separators=(",", ":"))) + 16) // 4)  # the context check's estimate
    assert counted.json() == {"input_tokens": expected}
    longer = await _post(coord, "/messages/count_tokens", {**body, "messages": [{"role": "user", "content": "hi " * 50}]},
                         account.headers())
    assert longer.json()["input_tokens"] > expected
    rows = httpx.get(coord.api_url + "/payments/usage", headers=account.headers()).json()["data"]
    assert balance(coord, account) == before and not any(row["model"] == model for row in rows)
    await _assert_anthropic_refusals(coord, [
        ("/messages/count_tokens", body, {"x-api-key": "dk-wrong"}, 401, "authentication_error"),
        ("/messages/count_tokens", {"model": model}, {"x-api-key": account.api_key}, 400, "invalid_request_error"),
        ("/messages/count_tokens", {**body, "model": "no-such"}, account.headers(), 404, "not_found_error")])


async def _assert_anthropic_refusals(coord: Coordinator,
                                     cases: list[tuple[str, dict[str, Any], dict[str, str], int, str]]) -> None:
    for path, sent, headers, status, kind in cases:
        refused = await _post(coord, path, sent, headers)
        assert refused.status_code == status, (path, refused.text)
        assert refused.json() == {"type": "error", "error": {"type": kind, "message": refused.json()["error"]["message"]}}


async def test_every_messages_path_answers_in_anthropics_envelope(coord: Coordinator, account: Account) -> None:
    body = {"model": "no-such", "max_tokens": 4, "messages": HELLO}
    await _assert_anthropic_refusals(coord, [
        ("/messages/batches", body, {"x-api-key": account.api_key}, 404, "not_found_error"),
        ("/messages/batches", body, {}, 404, "not_found_error"),
        ("/messages", body, {"x-api-key": "dk-wrong"}, 401, "authentication_error"),
        ("/messages", {**body, "pad": "x" * (9 << 20)}, {"x-api-key": account.api_key}, 413, "request_too_large")])
    wrong_method = httpx.get(coord.api_url + "/messages", headers=account.headers())
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert (await _post(coord, "/messagesx", body, account.headers())).json()["error"]["type"] == "not_found"


async def test_responses_stream_ends_with_response_completed(coord: Coordinator, account: Account) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model, ALL)
    request = asyncio.create_task(_post(coord, "/responses", {"model": model, "input": "hi", "stream": True},
                                        account.headers()))
    frame, forwarded = await asyncio.wait_for(raw.next_request(), 10)
    assert forwarded["messages"][-1]["role"] == "user" and "hi" in json.dumps(forwarded["messages"][-1])
    await raw.answer(frame, "hello")
    response = await request
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    kinds = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "[DONE]" not in response.text
    await raw.close()


async def test_a_429_no_wait_can_fix_says_do_not_retry(coord: Coordinator) -> None:
    model = _new_model(coord)
    raw = await _provider(coord, model)
    tight = create_account(coord, credit_micro_usd=CREDIT, otpm_limit=4, rpm_limit=2)
    hopeless = await _post(coord, "/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 8},
                           tight.headers())
    assert hopeless.status_code == 429 and hopeless.json()["error"]["param"] == "output_tokens"
    assert hopeless.headers["x-should-retry"] == "false" and "retry-after" not in hopeless.headers
    served = asyncio.create_task(_post(coord, "/chat/completions", {"model": model, "messages": HELLO,
                                                                    "max_tokens": 2}, tight.headers()))
    frame, _ = await asyncio.wait_for(raw.next_request(), 10)  # the refused request used the first of two
    await raw.answer(frame, "ok")
    assert (await served).status_code == 200
    again = await _post(coord, "/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 2},
                        tight.headers())  # the RPM bucket is spent for this minute: this one may wait
    assert again.status_code == 429 and again.json()["error"]["param"] == "requests"
    assert "x-should-retry" not in again.headers and int(again.headers["retry-after"]) >= 1
    await raw.close()


async def test_an_error_answer_carries_its_request_id(coord: Coordinator, account: Account) -> None:
    unknown = await _post(coord, "/chat/completions", {"model": "no-such-model", "messages": HELLO}, account.headers())
    assert unknown.status_code == 404 and unknown.headers["x-request-id"].startswith("chatcmpl-")
    anthropic = await _post(coord, "/messages", {"model": "no-such-model", "max_tokens": 4, "messages": HELLO},
                            {"x-api-key": account.api_key})
    assert anthropic.status_code == 404 and anthropic.headers["x-request-id"].startswith("msg_")
    anonymous = await _post(coord, "/chat/completions", {"model": "x", "messages": HELLO}, {})
    assert anonymous.status_code == 401 and "x-request-id" not in anonymous.headers  # no request yet
