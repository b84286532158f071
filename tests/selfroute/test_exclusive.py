"""Exclusive self-route (header `self`, key `self_route_only`): free, on the caller's own machine,
never the public fleet; how the header is read; rate limits still apply; the official `openai` SDK.

Acceptance points 1, 2, 3, 17, 18 and 19 of issue 5. One stack for the module: an owner with
zero balance and one machine, a funded owner with one machine, and another account's machine that
serves the same model to the public fleet (so a request that leaked to the fleet would show).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pytest

from tests.selfroute.support import (FIXED_ANSWER, MODEL, PREFER, SELF, Node, Stack, error_of, sse_events,
                                     start_upstream, streamed_text)
from tests.support.accounts import Account

pytestmark = pytest.mark.e2e


@dataclass
class World:
    stack: Stack
    owner: Account          # zero balance, owns `mine`
    mine: Node
    funded: Account         # 10 USD, owns `funded_node`
    funded_node: Node
    other: Account          # owns `public`, a machine of the public fleet
    public: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("exclusive")
    stack = Stack.start(root, replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=0)
        funded = stack.account(credit=10_000_000)
        other = stack.account(credit=0)
        mine = stack.node("mine", owner, upstream=url)
        funded_node = stack.node("funded-node", funded, upstream=url)
        public = stack.node("public", other, upstream=url)
        yield World(stack, owner, mine, funded, funded_node, other, public)
    finally:
        stack.close()


def _snapshot(w: World) -> dict[str, tuple[int, int]]:
    return w.stack.pockets()


# 1 ------------------------------------------------------------------------------------------------

def test_zero_balance_owner_streams_free_on_own_machine(world: World) -> None:
    w, s = world, world.stack
    assert s.balance(w.owner) == 0
    rows_before = s.usage(w.owner)
    pockets_before = _snapshot(w)
    public_before = w.public.accepted()

    response, text = s.stream(w.owner.api_key, SELF)

    assert response.status_code == 200, text
    assert response.headers["x-provider-id"] == w.mine.session_id
    assert response.headers["x-darkbloom-routed"] == "owned"
    assert response.headers["x-darkbloom-billing"] == "free"
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert streamed_text(text) == FIXED_ANSWER
    assert events[-2]["usage"]["completion_tokens"] > 0
    # free: the balance is still exactly 0, and nobody (provider owner, platform) earned anything
    assert s.balance(w.owner) == 0
    assert _snapshot(w) == pockets_before
    for account in (w.owner, w.other, w.funded):
        earnings = s.earnings(account)
        assert earnings["total_micro_usd"] == 0
        assert all(row["request_id"] != response.headers["x-request-id"] for row in earnings["data"])
    # exactly one new usage row, with cost 0, marked self-routed and owned
    rows = s.usage(w.owner)
    assert len(rows) == len(rows_before) + 1
    row = rows[0]
    assert row["request_id"] == response.headers["x-request-id"]
    assert row["cost_micro_usd"] == 0
    assert row["self_routed"] is True and row["routed"] == "owned"
    assert row["provider_id"] == w.mine.session_id and row["model"] == MODEL
    assert row["completion_tokens"] > 0
    assert w.public.accepted() == public_before


# 2 ------------------------------------------------------------------------------------------------

def test_self_route_only_key_is_exclusive_without_header_and_with_prefer(world: World) -> None:
    w, s = world, world.stack
    key = s.key(w.owner, self_route_only=True)
    public_before = w.public.accepted()
    rows_before = len(s.usage(w.owner))

    plain = s.chat(key)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
    assert plain.headers["x-provider-id"] == w.mine.session_id
    assert plain.headers["x-darkbloom-billing"] == "free"

    # `prefer` would reserve (and this account has no balance: 402); the key caps it to exclusive
    preferred = s.chat(key, PREFER)
    assert preferred.status_code == 200, preferred.text
    assert preferred.headers["x-provider-id"] == w.mine.session_id
    assert preferred.headers["x-darkbloom-routed"] == "owned"
    assert preferred.headers["x-darkbloom-billing"] == "free"

    assert s.balance(w.owner) == 0
    rows = s.usage(w.owner)
    assert len(rows) == rows_before + 2
    assert all(r["cost_micro_usd"] == 0 and r["self_routed"] for r in rows[:2])
    assert w.public.accepted() == public_before


def test_self_route_only_key_never_reaches_the_fleet(world: World) -> None:
    """An account with no machine and a funded balance: its self_route_only key gets the error,
    never a paid public answer (with and without `prefer`)."""
    s = world.stack
    caller = s.account(credit=10_000_000, self_route_only=True)
    public_before = world.public.accepted()
    for headers in ({}, PREFER):
        response = s.chat(caller.api_key, headers)
        assert response.status_code == 409, response.text
        assert error_of(response)["code"] == "no_linked_machine"
    assert s.balance(caller) == 10_000_000
    assert world.public.accepted() == public_before


def test_exclusive_skips_the_key_spend_cap(world: World) -> None:
    """A key capped at $0 cannot pay for anything, yet its owner's self-routed requests are served."""
    w, s = world, world.stack
    key = s.key(w.funded, limit_usd=0)
    refused = s.chat(key)
    assert refused.status_code == 402, refused.text
    assert error_of(refused)["type"] == "spend_cap_exceeded"
    before = s.balance(w.funded)
    for headers in (SELF, {}):
        capped_self_only = s.key(w.funded, limit_usd=0, self_route_only=True) if not headers else key
        served = s.chat(capped_self_only, headers)
        assert served.status_code == 200, served.text
        assert served.headers["x-provider-id"] == w.funded_node.session_id
        assert served.headers["x-darkbloom-billing"] == "free"
    assert s.balance(w.funded) == before


# 3 ------------------------------------------------------------------------------------------------

def test_zero_balance_owner_without_header_gets_402(world: World) -> None:
    w, s = world, world.stack
    mine_before, public_before = w.mine.accepted(), w.public.accepted()
    for stream in (False, True):
        response = s.chat(w.owner.api_key, stream=stream)
        assert response.status_code == 402, response.text
        error = error_of(response)
        assert error["type"] == "insufficient_funds" and error["code"] == "insufficient_quota"
    assert w.mine.accepted() == mine_before and w.public.accepted() == public_before
    assert s.balance(w.owner) == 0


# 17 -----------------------------------------------------------------------------------------------

def test_rpm_limit_rejects_self_routed_requests(world: World) -> None:
    w, s = world, world.stack
    key = s.key(w.owner, self_route_only=True, rpm_limit=1)
    first = s.chat(key)
    assert first.status_code == 200, first.text
    assert first.headers["x-darkbloom-billing"] == "free"
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    accepted = len(w.mine.accepted())
    refused = s.chat(key, SELF)
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert error["type"] == error["code"] == "rate_limit_exceeded"
    assert error["param"] == "requests"
    assert int(refused.headers["retry-after"]) >= 1
    assert len(w.mine.accepted()) == accepted  # refused before it reached the machine


@pytest.mark.parametrize("limit, param, fields", [
    ({"itpm_limit": 200}, "input_tokens", {"messages": [{"role": "user", "content": "word " * 400}]}),
    ({"otpm_limit": 20}, "output_tokens", {"max_tokens": 21}),
])
def test_token_limits_reject_self_routed_requests(world: World, limit: dict[str, int], param: str,
                                                  fields: dict[str, object]) -> None:
    w, s = world, world.stack
    key = s.key(w.owner, **limit)
    within = s.chat(key, SELF)  # the default short body fits the limit: served, free
    assert within.status_code == 200, within.text
    assert within.headers["x-darkbloom-billing"] == "free"
    accepted = len(w.mine.accepted())
    refused = s.chat(key, SELF, **fields)
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert error["type"] == "rate_limit_exceeded" and error["param"] == param
    # larger than the whole per-minute limit: no wait would admit it, so no Retry-After, and SDKs are
    # told not to retry
    assert refused.headers["x-should-retry"] == "false" and "retry-after" not in refused.headers
    assert len(w.mine.accepted()) == accepted


# 18 -----------------------------------------------------------------------------------------------

def test_header_spelled_with_spaces_and_capitals_is_recognised(world: World) -> None:
    w, s = world, world.stack
    status, headers, body = s.chat_raw_header(w.owner.api_key, "X-Darkbloom-Route", " SELF ")
    assert status == 200, body  # the zero-balance owner: only `self` makes it free
    assert headers["x-provider-id"] == w.mine.session_id
    assert headers["x-darkbloom-billing"] == "free"

    before = s.balance(w.funded)
    preferred = s.chat(w.funded.api_key, {"X-Darkbloom-Route": "Prefer"})
    assert preferred.status_code == 200, preferred.text
    assert preferred.headers["x-provider-id"] == w.funded_node.session_id
    assert preferred.headers["x-darkbloom-routed"] == "owned"
    assert preferred.headers["x-darkbloom-billing"] == "free"
    assert s.balance(w.funded) == before


@pytest.mark.parametrize("value", ["yes", ""])
def test_other_header_values_are_ignored(world: World, value: str) -> None:
    w, s = world, world.stack
    # for the zero-balance owner an ignored header is a plain paid request: 402, not an error about it
    unfunded = s.chat(w.owner.api_key, {"X-Darkbloom-Route": value})
    assert unfunded.status_code == 402, unfunded.text
    # for a funded owner it is charged like any public request (not free, as `prefer` would be)
    before = s.balance(w.funded)
    funded = s.chat(w.funded.api_key, {"X-Darkbloom-Route": value})
    assert funded.status_code == 200, funded.text
    assert funded.headers["x-darkbloom-billing"] == "charged"
    row = next(r for r in s.usage(w.funded) if r["request_id"] == funded.headers["x-request-id"])
    assert row["cost_micro_usd"] > 0 and row["self_routed"] is False
    assert s.balance(w.funded) == before - row["cost_micro_usd"]


# 19 -----------------------------------------------------------------------------------------------

def test_openai_sdk_with_extra_headers(world: World) -> None:
    from openai import OpenAI

    w, s = world, world.stack
    rows_before = len(s.usage(w.owner))
    client = OpenAI(base_url=s.url, api_key=w.owner.api_key, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Say something."}]

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=16,
                                                           extra_headers={"X-Darkbloom-Route": "self"})
    assert raw.headers["x-darkbloom-routed"] == "owned"
    assert raw.headers["x-darkbloom-billing"] == "free"
    completion = raw.parse()
    assert completion.choices[0].message.content == FIXED_ANSWER
    assert completion.model == MODEL
    assert completion.usage is not None and completion.usage.completion_tokens > 0

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Darkbloom-Route": "self"})
    parts, usage = [], None
    for chunk in stream:
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == FIXED_ANSWER
    assert usage is not None and usage.completion_tokens > 0

    # without the header the same zero-balance owner is refused: the header is what made it free
    import openai

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert refused.value.status_code == 402

    assert s.balance(w.owner) == 0
    rows = s.usage(w.owner)
    assert len(rows) == rows_before + 2
    assert all(r["cost_micro_usd"] == 0 and r["self_routed"] and r["routed"] == "owned" for r in rows[:2])
