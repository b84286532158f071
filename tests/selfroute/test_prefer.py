"""`X-Darkbloom-Route: prefer`: the caller's own machine whenever it can serve (free, the reservation
refunded), the paid public fleet otherwise; a prefer request served by an owned machine never gets a
paid backup; prefer reserves like any paid request, so an unfunded owner gets 402.

Acceptance points 9 and 10 of issue 5. The public machine answers instantly; the owner's machine
answers slowly (a chunk every 0.1 s), and both speeds are measured by the coordinator before the
prefer requests, so a scheduler that ranked by speed alone would pick the public one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from tests.selfroute.support import (FIXED_ANSWER, PREFER, SELF, Node, Stack, error_of, sse_events,
                                     start_upstream, streamed_text)
from tests.support.accounts import Account
from tests.support.raw_provider import ThreadedRaw
from darkbloom.store.schema import PLATFORM_ACCOUNT_ID

pytestmark = pytest.mark.e2e

FEE_BPS = 500
CREDIT = 10_000_000


@dataclass
class World:
    stack: Stack
    owner: Account       # funded, owns `mine` (slow)
    mine: Node
    other: Account       # owns `public` (fast), part of the public fleet
    public: Node
    fast_url: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("prefer")
    # a silent primary gets a speculative backup after 4 s (half the first-content budget)
    stack = Stack.start(root, "--first-content-timeout", "8", "--platform-fee-bps", str(FEE_BPS),
                        replicated=replicated)
    try:
        fast, fast_url = start_upstream(root / "fast")
        slow, slow_url = start_upstream(root / "slow", "--delay", "0.1")
        stack.processes += [fast, slow]
        owner = stack.account(credit=CREDIT)
        other = stack.account(credit=0)
        public = stack.node("public", other, upstream=fast_url)
        mine = stack.node("mine", owner, upstream=slow_url)
        # measure both machines' decode speed: each owner's own free request lands on its own machine
        for account, node in ((other, public), (owner, mine)):
            warm = stack.chat(account.api_key, SELF)
            assert warm.status_code == 200 and warm.headers["x-provider-id"] == node.session_id, warm.text
        yield World(stack, owner, mine, other, public, fast_url)
    finally:
        stack.close()


def _answered_cost(response: httpx.Response, streamed: str | None = None) -> int:
    """The cost an answer says: a whole one in its header and usage (the same), a stream in its usage chunk."""
    if streamed is not None:
        usage = [event["usage"] for event in sse_events(streamed) if isinstance(event, dict) and event.get("usage")]
        assert len(usage) == 1
        return int(usage[0]["cost_micro_usd"])
    cost = response.json()["usage"]["cost_micro_usd"]
    assert response.headers["x-darkbloom-cost-micro-usd"] == str(cost)
    return int(cost)


def test_the_public_machine_is_the_faster_choice(world: World) -> None:
    """The premise of the next test: for a plain public request the scheduler picks the fast public
    machine over the owner's slow one."""
    s = world.stack
    caller = s.account(credit=CREDIT)
    for _ in range(3):
        response = s.chat(caller.api_key)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == world.public.session_id


# 9 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_prefer_uses_own_machine_even_when_a_faster_public_one_is_idle(world: World, stream: bool) -> None:
    w, s = world, world.stack
    start = s.balance(w.owner)
    public_before = w.public.accepted()
    for _ in range(3):
        if stream:
            response, text = s.stream(w.owner.api_key, PREFER)
            assert streamed_text(text) == FIXED_ANSWER
        else:
            response = s.chat(w.owner.api_key, PREFER)
            assert response.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
        assert response.status_code == 200
        assert response.headers["x-provider-id"] == w.mine.session_id
        assert response.headers["x-darkbloom-routed"] == "owned"
        assert response.headers["x-darkbloom-billing"] == "free"
        request_id = response.headers["x-request-id"]
        # a normal reservation was taken up front and all of it refunded; nothing else moved
        entries = s.ledger(request_id)
        kinds = [(account, kind) for account, kind, _, _ in entries]
        assert kinds == [(w.owner.account_id, "reservation"), (w.owner.account_id, "refund")]
        assert entries[0][3] < 0 and entries[1][3] == -entries[0][3]
        row = next(r for r in s.usage(w.owner) if r["request_id"] == request_id)
        assert row["cost_micro_usd"] == 0 and row["self_routed"] is True and row["routed"] == "owned"
        assert _answered_cost(response, text if stream else None) == 0  # the answer says it was free
    assert s.balance(w.owner) == start
    assert w.public.accepted() == public_before


def test_prefer_reserves_so_an_unfunded_owner_gets_402(world: World) -> None:
    s = world.stack
    owner = s.account(credit=0)
    machine: ThreadedRaw = s.raw(owner, answer="hello")
    try:
        response = s.chat(owner.api_key, PREFER)
        assert response.status_code == 402, response.text
        error = error_of(response)
        assert error["type"] == "insufficient_funds" and error["code"] == "insufficient_quota"
        # the same owner with `self` is served free by that machine
        served = s.chat(owner.api_key, SELF)
        assert served.status_code == 200, served.text
        assert served.headers["x-provider-id"] == machine.session_id
        assert machine.requests == [served.headers["x-request-id"]]
        assert s.balance(owner) == 0
    finally:
        machine.close()


def test_prefer_on_own_machine_gets_no_paid_backup(world: World) -> None:
    """The owner's machine stays silent past half the first-content budget while the fast public
    machine is idle: a paid backup would start there and win. It must not."""
    s = world.stack
    owner = s.account(credit=CREDIT)
    slow_start = s.node("slow-start", owner, upstream=world.fast_url, first_token_delay=5.5)
    try:
        public_before = world.public.accepted()
        response = s.chat(owner.api_key, PREFER)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == slow_start.session_id
        assert response.headers["x-darkbloom-billing"] == "free"
        assert world.public.accepted() == public_before
        assert s.balance(owner) == CREDIT
    finally:
        slow_start.stop()


# 10 -----------------------------------------------------------------------------------------------

def test_prefer_without_own_machine_is_served_by_the_fleet_and_paid(world: World) -> None:
    w, s = world, world.stack
    caller = s.account(credit=CREDIT)
    owners = {w.public.session_id: w.other, w.mine.session_id: w.owner}
    earned_before = {a.account_id: s.earnings(a)["total_micro_usd"] for a in owners.values()}
    platform_before = s.platform_withdrawable()

    response = s.chat(caller.api_key, PREFER)

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
    assert response.headers["x-darkbloom-routed"] == "fleet"
    assert response.headers["x-darkbloom-billing"] == "charged"
    provider_owner = owners[response.headers["x-provider-id"]]
    request_id = response.headers["x-request-id"]
    row = next(r for r in s.usage(caller) if r["request_id"] == request_id)
    cost = row["cost_micro_usd"]
    assert cost > 0 and row["self_routed"] is False and row["routed"] == "fleet"
    assert _answered_cost(response) == cost  # the answer says the charge
    fee = cost * FEE_BPS // 10_000
    assert s.balance(caller) == CREDIT - cost
    earnings = s.earnings(provider_owner)
    assert earnings["total_micro_usd"] == earned_before[provider_owner.account_id] + cost - fee
    assert next(r for r in earnings["data"] if r["request_id"] == request_id)["payout_micro_usd"] == cost - fee
    assert s.platform_withdrawable() == platform_before + fee
    assert (PLATFORM_ACCOUNT_ID, "platform_fee", "withdrawable", fee) in s.ledger(request_id)
