"""`--min-trust hardware`: the owner's un-enrolled (`self_signed`) machine never serves the public
fleet, but the floor is relaxed for the owner's own self-route requests (`self` and `prefer`).

Acceptance point 12 of issue 5. Another account's machine is enrolled (`hardware`), so public
routing works in this module and public requests have somewhere to go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from tests.selfroute.support import MODEL, PREFER, SELF, Node, Stack, error_of, start_upstream
from tests.support.accounts import Account
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

CREDIT = 10_000_000


@dataclass
class World:
    stack: Stack
    owner: Account
    mine: Node
    enrolled: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("trust-floor")
    stack = Stack.start(root, "--min-trust", "hardware", replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=CREDIT)
        mine = stack.node("mine", owner, upstream=url)
        other = stack.account()
        enrolled = stack.node("enrolled", other, upstream=url)
        yield World(stack, owner, mine, enrolled)
    finally:
        stack.close()


def test_public_requests_never_reach_a_self_signed_machine(world: World) -> None:
    w, s = world, world.stack
    assert "trust self_signed" in w.mine.log()
    stranger = s.account(credit=CREDIT)
    for token in (stranger.api_key, w.owner.api_key):  # the owner too, when not self-routing
        response = s.chat(token)
        assert response.status_code == 503, response.text
        assert error_of(response)["type"] == "model_unavailable"
        assert [m["id"] for m in s.get("/models", token).json()["data"]] == []
    assert w.mine.accepted() == [] and w.enrolled.accepted() == []
    assert s.balance(stranger) == CREDIT


def test_owner_self_and_prefer_reach_the_self_signed_machine(world: World) -> None:
    w, s = world, world.stack
    before = s.balance(w.owner)
    for headers in (SELF, PREFER):
        response = s.chat(w.owner.api_key, headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == w.mine.session_id
        assert response.headers["x-darkbloom-routed"] == "owned"
        assert response.headers["x-darkbloom-billing"] == "free"
    assert s.balance(w.owner) == before
    assert [m["id"] for m in s.get("/models", w.owner.api_key, SELF).json()["data"]] == [MODEL]


def test_with_an_enrolled_public_machine_public_requests_still_avoid_it(world: World) -> None:
    w, s = world, world.stack
    [other_machine] = _machine_of_node(s, w.enrolled)
    enrolled = httpx.post(s.url + f"/admin/machines/{other_machine}/enroll", headers=s.coordinator.admin())
    assert enrolled.status_code == 200, enrolled.text
    wait_until(lambda: "trust level now hardware" in w.enrolled.log(), timeout=30,
               what="the node raised to hardware")
    stranger = s.account(credit=CREDIT)
    mine_before = w.mine.accepted()
    for _ in range(4):
        response = s.chat(stranger.api_key)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == w.enrolled.session_id
    assert w.mine.accepted() == mine_before
    # the owner's prefer still picks its own machine over the (now routable) enrolled one
    preferred = s.chat(w.owner.api_key, PREFER)
    assert preferred.status_code == 200 and preferred.headers["x-provider-id"] == w.mine.session_id


def _machine_of_node(s: Stack, node: Node) -> list[str]:
    """The `mach_…` id of a node, from its own device token (the node's account lists it)."""
    token = (node.home / "auth_token").read_text().strip()
    listing = httpx.get(s.url + "/me/providers", headers={"Authorization": f"Bearer {token}"})
    assert listing.status_code == 200, listing.text
    return [m["id"] for m in listing.json()["data"] if m["session_id"] == node.session_id]
