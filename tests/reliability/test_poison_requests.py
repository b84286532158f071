"""Poison requests and what a provider's failure may tell the consumer (issue 19, rows 1, 5 and 14),
against a real coordinator with raw providers:

- a schema bound no grammar holds is a 400 naming it, before anything is reserved or sent;
- a request that takes its node down with it goes to one more node at most, then fails by name,
  uncharged, with no usage row — never walked across the fleet;
- after first content, the stream's error is the coordinator's sentence on every streaming API;
- a refusal's `param` reaches the consumer only when it names a path of the request's own body.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Iterator

import httpx
import pytest

from tests.support.accounts import Account, balance, create_account
from tests.support.hostile import (
    balance_settles_at, crash_on_request, new_model, registered, usage_ids)
from tests.support.processes import Coordinator, sqlite_coordinator

pytestmark = pytest.mark.e2e

SECRET = "/home/provider/secret.gguf user=bob " + secrets.token_hex(4)
HELLO = [{"role": "user", "content": "hi"}]
CRASHED = "darkbloom_requests_crashed_providers_total"


@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    with sqlite_coordinator(tmp_path_factory.mktemp("poison"), "--first-content-timeout", "10") as process:
        yield process


@pytest.fixture(scope="module")
def account(coord: Coordinator) -> Account:
    return create_account(coord, credit_micro_usd=10_000_000)


def _post(coord: Coordinator, account: Account, path: str, body: dict[str, Any],
          http: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(http.post(coord.api_url + path, json=body, headers=account.headers()))


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "string", "maxLength": 20000}}}},
     "response_format.json_schema.schema.maxLength"),
    ("/chat/completions", {"messages": HELLO, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30000}}}}}]},
     "tools[0].function.parameters.properties.a.maxLength"),
    ("/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "b",
                                                       "schema": {"type": "array", "maxItems": 50000}}}},
     "text.format.schema.maxItems"),
])
async def test_a_schema_bound_no_grammar_holds_is_refused_before_anything_is_reserved_or_sent(
        coord: Coordinator, account: Account, path: str, body: dict[str, Any], param: str) -> None:
    model = new_model(coord)
    raw = await registered(coord, model, ("tools", "structured_output"))
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await _post(coord, account, path, {"model": model, **body}, http)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["param"] == param
    assert balance(coord, account) == before
    async with httpx.AsyncClient(timeout=30) as http:  # the provider's next request: one sent before would be first
        probe = _post(coord, account, "/chat/completions", {"model": model, "messages": HELLO}, http)
        request, _ = await raw.next_request()
        await raw.answer(request, "probe")
        assert (await probe).status_code == 200
    assert raw.seen_requests == {request.request_id}
    await raw.close()


async def test_a_request_that_crashes_its_nodes_reaches_two_of_three_and_fails_by_name_uncharged(
        coord: Coordinator, account: Account) -> None:
    model = new_model(coord)
    providers = [await registered(coord, model) for _ in range(3)]
    crashes = [asyncio.create_task(crash_on_request(raw)) for raw in providers]
    before, counted = balance(coord, account), coord.metric(CRASHED)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await _post(coord, account, "/chat/completions", {"model": model, "messages": HELLO}, http)
    for task in crashes:
        task.cancel()
    await asyncio.gather(*crashes, return_exceptions=True)
    # a third attempt would be dispatched before the answer: it would reach a node ahead of this barrier
    for raw in providers:
        if not raw.seen_requests:
            await raw.round_trip()
    reached = [raw for raw in providers if raw.seen_requests]
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("provider_error", "request_crashed_providers")
    assert response.headers["x-should-retry"] == "false"
    assert len(reached) == 2
    request_id = response.headers["x-request-id"]
    await balance_settles_at(coord, account, before)
    assert request_id not in usage_ids(coord, account)
    assert coord.metric(CRASHED) == counted + 1
    for raw in providers:
        await raw.close()


@pytest.mark.parametrize("path,body,capabilities,content", [
    ("/chat/completions", {"messages": HELLO}, (), {"delta": {"content": "first words"}}),
    ("/completions", {"prompt": "Once"}, ("completions",), {"text": "first words"}),
    ("/responses", {"input": "hi"}, (), {"delta": {"content": "first words"}}),
    ("/messages", {"messages": HELLO, "max_tokens": 16}, (), {"delta": {"content": "first words"}}),
])
async def test_an_error_after_first_content_is_the_coordinators_sentence_on_every_stream(
        coord: Coordinator, account: Account, path: str, body: dict[str, Any], capabilities: tuple[str, ...],
        content: dict[str, Any]) -> None:
    model = new_model(coord)
    raw = await registered(coord, model, capabilities)
    before = balance(coord, account)
    async with httpx.AsyncClient(timeout=30) as http:
        request = _post(coord, account, path, {"model": model, "stream": True, **body}, http)
        inference, _ = await raw.next_request()
        await raw.send_data(inference, {"choices": [{"index": 0, "finish_reason": None, **content}]})
        await raw.send_error(inference, 500, SECRET)
        response = await request
    assert response.status_code == 200 and "first words" in response.text
    assert "error" in response.text and "[DONE]" not in response.text
    assert SECRET not in response.text and "secret.gguf" not in response.text
    await balance_settles_at(coord, account, before)
    await raw.close()


@pytest.mark.parametrize("sent,expected", [
    ("visit.evil-example.com.for-a-refund", None), ("messages[0].content", "messages[0].content"),
    ("messages[3].content", None), ("temperature", "temperature"), ("tools", None),
])
async def test_a_refusals_param_reaches_the_consumer_only_when_it_names_a_path_of_the_body(
        coord: Coordinator, account: Account, sent: str, expected: str | None) -> None:
    model = new_model(coord)
    raw = await registered(coord, model)
    async with httpx.AsyncClient(timeout=30) as http:
        request = _post(coord, account, "/chat/completions", {"model": model, "messages": HELLO,
                                                              "temperature": 0.5}, http)
        inference, _ = await raw.next_request()
        await raw.send_error(inference, 400, SECRET, param=sent)
        response = await request
    assert response.status_code == 400
    assert response.json()["error"]["param"] == expected
    assert SECRET not in response.text
    await raw.close()
