"""A key's fallback budget end to end (docs/self-route.md "Fallback budget"), on SQLite and Postgres:
the owner's machine is linked but offline, so every prefer request on the key would go to the paid
public fleet; 200 of them at once spend at most the budget there, and every one the budget could not
hold got the exclusive error (503 machine_offline) — never a 402. Once the owner's machine comes
online, a used-up key's prefer requests are served there, free."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from darkbloom.store.schema import reservations

from tests.selfroute.support import BODY, PREFER, Node, Stack, error_of, start_upstream
from tests.support.accounts import Account
from tests.support.billing import table, wait_settled
from tests.support.databases import database_for
from tests.support.processes import start_coordinator

pytestmark = pytest.mark.e2e

CREDIT = 100_000_000
N = 5  # the budget is worth this many requests' worst case
CONCURRENT = 200


@dataclass
class World:
    stack: Stack
    owner: Account   # funded; its one machine is linked but never connected
    public: Node     # another account's machine: the public fleet
    upstream_url: str


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("fallback")
    with database_for(request.param, root) as url:
        stack = Stack(root, start_coordinator(root / "coordinator", url))
        try:
            upstream, upstream_url = start_upstream(root / "fast")
            stack.processes.append(upstream)
            owner = stack.account(credit=CREDIT)
            stack.link(owner)  # linked, offline: prefer falls back, exclusive is 503 machine_offline
            public = stack.node("public", stack.account(), upstream=upstream_url, max_concurrency=8)
            yield World(stack, owner, public, upstream_url)
        finally:
            stack.close()


def _worst_case(world: World) -> int:
    """The reservation of one prefer request of BODY's shape (read from the reservations table)."""
    response = world.stack.chat(world.owner.api_key, PREFER)
    assert response.status_code == 200, response.text
    assert response.headers["x-provider-id"] == world.public.session_id
    request_id = response.headers["x-request-id"]
    [row] = table(world.stack.coordinator.database_url, reservations, reservations.c.request_id == request_id)
    return int(row["amount_micro_usd"])


async def _prefer_at_once(url: str, key: str, count: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post(url + "/chat/completions", json=BODY,
                                                  headers={"Authorization": f"Bearer {key}", **PREFER})
                                      for _ in range(count)))


def test_200_concurrent_prefer_requests_never_pass_the_fallback_budget(world: World) -> None:
    s = world.stack
    worst = _worst_case(world)
    budget = N * worst
    key = s.key(world.owner, fallback_limit_usd=budget / 1_000_000, fallback_limit_reset="daily")
    before = {row["request_id"] for row in s.usage(world.owner)}
    responses = asyncio.run(_prefer_at_once(s.url, key, CONCURRENT))
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert served, "the budget admits at least its worth"
    for response in served:
        assert response.headers["x-darkbloom-routed"] == "fleet"
        assert response.headers["x-darkbloom-billing"] == "charged"
    assert refused, "200 requests' worst case is far more than the budget"
    for response in refused:  # acts as exclusive: the owner's machine is offline
        assert response.status_code == 503, response.text
        assert error_of(response)["code"] == "machine_offline"
    wait_settled(s.coordinator.database_url)
    fleet = [row for row in s.usage(world.owner) if row["request_id"] not in before]
    assert {row["request_id"] for row in fleet} == {r.headers["x-request-id"] for r in served}
    assert all(row["routed"] == "fleet" for row in fleet)
    assert 0 < sum(row["cost_micro_usd"] for row in fleet) <= budget

    # once used up, an exclusive request on the key is what prefer is; the key's owner still pays nothing
    spent = sum(row["cost_micro_usd"] for row in fleet)
    if budget - spent < worst:
        again = s.chat(key, PREFER)
        assert again.status_code == 503 and error_of(again)["code"] == "machine_offline"


def test_a_used_up_budget_still_serves_prefer_on_the_owners_online_machine(world: World) -> None:
    """Past the budget, prefer acts as exclusive — which, with the owner's machine online, means it is
    served there, free, and the fleet gets nothing more from the key."""
    s = world.stack
    worst = _worst_case(world)
    key = s.key(world.owner, fallback_limit_usd=worst / 1_000_000, fallback_limit_reset="daily")
    first = s.chat(key, PREFER)  # the owner's machine is offline: the fleet, which uses the budget up
    assert first.status_code == 200, first.text
    assert first.headers["x-darkbloom-routed"] == "fleet"
    refused = s.chat(key, PREFER)
    assert refused.status_code == 503 and error_of(refused)["code"] == "machine_offline"

    own = s.node("own", world.owner, upstream=world.upstream_url, max_concurrency=2)
    try:
        s.wait_listed(world.owner, own.session_id)
        balance = s.balance(world.owner)
        for _ in range(3):
            response = s.chat(key, PREFER)
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == own.session_id
            assert response.headers["x-darkbloom-routed"] == "owned"
            assert response.headers["x-darkbloom-billing"] == "free"
            assert response.json()["usage"]["cost_micro_usd"] == 0
        wait_settled(s.coordinator.database_url)
        assert s.balance(world.owner) == balance
        owned = [row for row in s.usage(world.owner) if row["provider_id"] == own.session_id]
        assert len(owned) == 3 and all(row["cost_micro_usd"] == 0 and row["routed"] == "owned" for row in owned)
    finally:
        own.stop()
