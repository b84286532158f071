"""What happens to a self-routed request while it is in flight: the machine serving it dies before
its first content (sequential retry stays on the owner's machines), or the machine is unlinked from
the account mid-flight (settlement re-reads the owner of the session that served: paid, and when
the charge cannot be collected nobody is paid).

Acceptance points 11 and 14 of issue 5. The owner's machines delay their first token
(tests/support/backends.py FirstTokenDelayBackend, via tests.support.node_main) so the test knows they are before first content when it acts.
Another account's machine serves the same model to the public fleet throughout.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from tests.selfroute.support import (FIXED_ANSWER, PREFER, SELF, Node, Stack, error_of, start_upstream,
                                     wait_accepted)
from tests.support.accounts import Account
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

FEE_BPS = 500


@dataclass
class World:
    stack: Stack
    upstream: str
    public: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("midflight")
    stack = Stack.start(root, "--platform-fee-bps", str(FEE_BPS), replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        public = stack.node("public", stack.account(), upstream=url)
        yield World(stack, url, public)
    finally:
        stack.close()


def _send(stack: Stack, token: str, headers: dict[str, str]) -> tuple[Future[httpx.Response], ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    return pool.submit(stack.chat, token, headers), pool


# 14 -----------------------------------------------------------------------------------------------

def test_exclusive_retry_moves_to_the_owners_other_machine(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=0)
    machines = [s.node(f"retry-{i}", owner, upstream=w.upstream, max_concurrency=1, first_token_delay=3)
                for i in range(2)]
    try:
        public_before = w.public.accepted()
        future, pool = _send(s, owner.api_key, SELF)
        victim = wait_until(lambda: next((m for m in machines if m.accepted()), None), timeout=30,
                            what="the request on one of the owner's machines")
        request_id = victim.accepted()[0]
        victim.kill()  # SIGKILL before its first token
        survivor = next(m for m in machines if m is not victim)
        response = future.result()
        pool.shutdown()
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
        assert response.headers["x-request-id"] == request_id
        assert response.headers["x-provider-id"] == survivor.session_id
        assert response.headers["x-darkbloom-billing"] == "free"
        assert survivor.accepted() == [request_id]
        assert w.public.accepted() == public_before
        assert s.balance(owner) == 0
    finally:
        for machine in machines:
            machine.stop()


def test_exclusive_retry_with_one_machine_fails_and_never_goes_public(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=10_000_000)  # funded: a leak to the paid fleet could be served and charged
    machine = s.node("alone", owner, upstream=w.upstream, max_concurrency=1, first_token_delay=30)
    try:
        public_before = w.public.accepted()
        future, pool = _send(s, owner.api_key, SELF)
        wait_accepted(machine, future)
        machine.kill()
        response = future.result()
        pool.shutdown()
        # the named error of the state the owner's machines are now in, never a public answer
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["type"] == error["code"] == "machine_offline"
        assert response.headers["retry-after"] == "30"
        assert w.public.accepted() == public_before
        assert s.balance(owner) == 10_000_000
        assert s.usage(owner) == []
    finally:
        machine.stop()


# 11 -----------------------------------------------------------------------------------------------

def _unlink_mid_flight(s: Stack, owner: Account, node: Node, headers: dict[str, str]) -> httpx.Response:
    """Send a request the owner's machine will serve, and unlink that machine before its first token."""
    machine_id = s.machine_of(owner, node.session_id)
    future, pool = _send(s, owner.api_key, headers)
    wait_accepted(node, future)
    unlinked = httpx.delete(s.url + f"/me/providers/{machine_id}", headers=owner.headers(owner.session))
    assert unlinked.status_code == 200, unlinked.text
    response = future.result()
    pool.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
    assert response.headers["x-provider-id"] == node.session_id
    assert machine_id not in [m["id"] for m in s.machines(owner)]
    return response


def test_owner_changed_mid_flight_settles_prefer_as_paid(world: World) -> None:
    w, s = world, world.stack
    credit = 10_000_000
    owner = s.account(credit=credit)
    node = s.node("unlinked-prefer", owner, upstream=w.upstream, max_concurrency=1, first_token_delay=3)
    try:
        platform_before = s.platform_withdrawable()
        response = _unlink_mid_flight(s, owner, node, PREFER)
        assert response.headers["x-darkbloom-billing"] == "charged"
        row = next(r for r in s.usage(owner) if r["request_id"] == response.headers["x-request-id"])
        cost = row["cost_micro_usd"]
        assert cost > 0
        assert row["self_routed"] is False and row["routed"] == "fleet" and "ownership_changed" not in row
        assert s.balance(owner) == credit - cost
        # the session belongs to no account any more: fee and payout both go to the platform
        assert s.platform_withdrawable() == platform_before + cost
        assert s.earnings(owner)["total_micro_usd"] == 0
    finally:
        node.stop()


@pytest.mark.parametrize("credit", [10_000_000, 0], ids=["funded", "unfunded"])
def test_exclusive_is_free_even_when_the_owner_changed_mid_flight(world: World, credit: int) -> None:
    """Exclusive guarantees $0: unlinking the serving machine mid-request charges nothing, pays
    nobody, and the usage row says why (ownership_changed); the billing header agrees."""
    w, s = world, world.stack
    owner = s.account(credit=credit)
    node = s.node(f"unlinked-exclusive-{credit}", owner, upstream=w.upstream, max_concurrency=1,
                  first_token_delay=3)
    try:
        pockets_before = s.pockets()
        response = _unlink_mid_flight(s, owner, node, SELF)
        assert response.headers["x-darkbloom-billing"] == "free"
        request_id = response.headers["x-request-id"]
        row = next(r for r in s.usage(owner) if r["request_id"] == request_id)
        assert row["ownership_changed"] is True and row["self_routed"] is True
        assert row["cost_micro_usd"] == 0
        # nobody was paid: every account's balance and withdrawable (the platform's included) unchanged
        assert s.pockets() == pockets_before
        assert not [entry for entry in s.ledger(request_id) if entry[1] in ("payout", "platform_fee", "charge")]
        assert s.earnings(owner)["total_micro_usd"] == 0
    finally:
        node.stop()
