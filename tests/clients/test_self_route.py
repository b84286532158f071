"""The same requests through `X-Darkbloom-Route: self`, sent by the node's owner with the clients'
own header options: each answer says free and owned (a whole one also says it cost 0, in its usage
and `X-Darkbloom-Cost-Micro-USD`), the owner's balance does not move, and the request's usage row
costs 0 and is marked self-routed."""

from __future__ import annotations

from typing import Any, Iterator

import anthropic
import pytest
from openai import OpenAI

from tests.clients.support import (FORCE_WEATHER, MESSAGES, MODEL, PROMPT, SELF, WEATHER_PROMPT, WEATHER_SCHEMA,
                                   WEATHER_TOOL, Stack, cell, valid)

pytestmark = pytest.mark.e2e

CLIENT = "self-route"


@pytest.fixture
def owned(stack: Stack) -> Iterator[list[Any]]:
    """Collects each request's raw response; afterwards checks headers, balance and usage rows."""
    before = stack.balance(stack.owner)
    answers: list[Any] = []
    yield answers
    assert answers
    for raw in answers:
        assert raw.headers["x-darkbloom-billing"] == "free", dict(raw.headers)
        assert raw.headers["x-darkbloom-routed"] == "owned", dict(raw.headers)
        if raw.headers["content-type"].startswith("application/json"):  # a whole answer
            assert raw.headers["x-darkbloom-cost-micro-usd"] == "0", dict(raw.headers)
            assert raw.http_response.json()["usage"]["cost_micro_usd"] == 0
        row = stack.usage_row(stack.owner, raw.headers["x-request-id"])
        assert row["cost_micro_usd"] == 0 and row["self_routed"] is True and row["routed"] == "owned", row
    assert stack.balance(stack.owner) == before


def sdk(stack: Stack, token: str | None = None) -> OpenAI:
    return OpenAI(base_url=stack.api_url, api_key=token or stack.owner.api_key, max_retries=0, default_headers=SELF)


@cell(CLIENT, "chat")
@pytest.mark.parametrize("token", ["api_key", "device_token"])
def test_chat(stack: Stack, owned: list[Any], token: str) -> None:
    secret = stack.owner.api_key if token == "api_key" else stack.device_token
    raw = sdk(stack, secret).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert raw.parse().usage.completion_tokens > 0
    owned.append(raw)


@cell(CLIENT, "stream")
def test_stream(stack: Stack, owned: list[Any]) -> None:
    raw = sdk(stack).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                               stream=True)
    assert [c.choices[0].delta.content or "" for c in raw.parse()]
    owned.append(raw)


@cell(CLIENT, "tool")
def test_tool_call(stack: Stack, owned: list[Any]) -> None:
    raw = sdk(stack).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=64, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,  # type: ignore[list-item, arg-type]
        messages=[{"role": "user", "content": WEATHER_PROMPT}])
    valid(raw.parse().choices[0].message.tool_calls[0].function.arguments, WEATHER_SCHEMA)
    owned.append(raw)


@cell(CLIENT, "responses")
def test_responses(stack: Stack, owned: list[Any]) -> None:
    raw = sdk(stack).responses.with_raw_response.create(model=MODEL, input=PROMPT, max_output_tokens=8)
    assert raw.parse().status in ("completed", "incomplete")
    owned.append(raw)


@cell(CLIENT, "completions")
def test_completions(stack: Stack, owned: list[Any]) -> None:
    raw = sdk(stack).completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert raw.parse().object == "text_completion"
    owned.append(raw)


@cell(CLIENT, "embeddings")
def test_embeddings(stack: Stack, owned: list[Any]) -> None:
    raw = sdk(stack).embeddings.with_raw_response.create(model=MODEL, input="red")
    assert raw.parse().data[0].embedding
    owned.append(raw)


@cell(CLIENT, "messages")
def test_messages(stack: Stack, owned: list[Any]) -> None:
    client = anthropic.Anthropic(base_url=stack.base_url, api_key=stack.owner.api_key, max_retries=0,
                                 default_headers=SELF)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=8,
                                                   messages=[{"role": "user", "content": PROMPT}])
    assert raw.parse().type == "message"
    owned.append(raw)
