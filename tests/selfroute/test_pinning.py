"""Machine pinning: `X-Darkbloom-Machine: <mach_… or prov_…>` on an exclusive request routes to
exactly that owned machine, on every attempt; malformed pins are 400s; an unknown id and another
account's id are indistinguishable 404s.

Acceptance point 15 of issue 5 (and scope item 4: the pin is kept on every retry).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from tests.selfroute.support import (BODY, PREFER, SELF, Node, Stack, error_of, start_upstream,
                                     wait_accepted)
from tests.support.accounts import Account
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

PIN = "X-Darkbloom-Machine"


@dataclass
class World:
    stack: Stack
    upstream: str
    owner: Account
    first: Node
    second: Node
    other: Account
    others_node: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("pinning")
    stack = Stack.start(root, replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=0)
        other = stack.account(credit=0)
        first = stack.node("first", owner, upstream=url)
        second = stack.node("second", owner, upstream=url)
        others_node = stack.node("others", other, upstream=url)
        yield World(stack, url, owner, first, second, other, others_node)
    finally:
        stack.close()


@pytest.mark.parametrize("by", ["machine", "session"])
def test_pin_routes_to_exactly_that_machine(world: World, by: str) -> None:
    w, s = world, world.stack
    for target in (w.first, w.second):
        pin = s.machine_of(w.owner, target.session_id) if by == "machine" else target.session_id
        assert pin.startswith("mach_" if by == "machine" else "prov_")
        before = {node.session_id: len(node.accepted()) for node in (w.first, w.second, w.others_node)}
        for stream in (False, True, False, True):
            if stream:
                response, text = s.stream(w.owner.api_key, {**SELF, PIN: pin})
                assert "[DONE]" in text
            else:
                response = s.chat(w.owner.api_key, {**SELF, PIN: pin})
            assert response.status_code == 200, response.text if not stream else text
            assert response.headers["x-provider-id"] == target.session_id
            assert response.headers["x-darkbloom-billing"] == "free"
        after = {node.session_id: len(node.accepted()) for node in (w.first, w.second, w.others_node)}
        assert after[target.session_id] == before[target.session_id] + 4
        assert all(after[n] == before[n] for n in after if n != target.session_id)


def test_pin_works_with_a_self_route_only_key(world: World) -> None:
    w, s = world, world.stack
    key = s.key(w.owner, self_route_only=True)
    response = s.chat(key, {PIN: s.machine_of(w.owner, w.second.session_id)})
    assert response.status_code == 200, response.text
    assert response.headers["x-provider-id"] == w.second.session_id


def _pinned(s: Stack, token: str, headers: list[tuple[str, str]]) -> httpx.Response:
    return httpx.post(s.url + "/chat/completions", json=BODY,
                      headers=[("Authorization", f"Bearer {token}"), *headers], timeout=60)


@pytest.mark.parametrize("case", ["no_exclusive_policy", "prefer", "twice", "blank", "comma", "too_long"])
def test_malformed_pins_are_400(world: World, case: str) -> None:
    w, s = world, world.stack
    mine = s.machine_of(w.owner, w.first.session_id)
    theirs = s.machine_of(w.owner, w.second.session_id)
    route = [("X-Darkbloom-Route", "self")]
    headers = {
        "no_exclusive_policy": [(PIN, mine)],
        "prefer": [("X-Darkbloom-Route", "prefer"), (PIN, mine)],
        "twice": [*route, (PIN, mine), (PIN, mine)],
        "blank": [*route, (PIN, "")],
        "comma": [*route, (PIN, f"{mine},{theirs}")],
        "too_long": [*route, (PIN, "mach_" + "a" * 252)],  # 257 characters
    }[case]
    accepted = len(w.first.accepted()) + len(w.second.accepted())
    token = w.owner.api_key
    if case == "prefer":
        token = s.account(credit=10_000_000).api_key  # funded, so prefer itself would be served
    response = _pinned(s, token, headers)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == error["code"] == "invalid_request_error"
    assert error["param"] == PIN
    assert len(w.first.accepted()) + len(w.second.accepted()) == accepted


def test_a_pin_of_exactly_256_characters_is_not_malformed(world: World) -> None:
    response = _pinned(world.stack, world.owner.api_key, [("X-Darkbloom-Route", "self"), (PIN, "mach_" + "a" * 251)])
    assert response.status_code == 404, response.text  # well formed, just not one of the owner's machines


def test_unknown_and_foreign_machine_ids_give_the_same_404(world: World) -> None:
    w, s = world, world.stack
    foreign_machine = s.machine_of(w.other, w.others_node.session_id)
    others_before = w.others_node.accepted()
    bodies = []
    for pin in ("mach_" + "0" * 24, foreign_machine, "prov_" + "0" * 24, w.others_node.session_id):
        response = s.chat(w.owner.api_key, {**SELF, PIN: pin})
        assert response.status_code == 404, response.text
        assert error_of(response)["type"] == error_of(response)["code"] == "machine_not_found"
        bodies.append(response.content)
    assert bodies[0] == bodies[1] == bodies[2] == bodies[3]
    assert w.others_node.accepted() == others_before


def test_owned_but_offline_pin_is_machine_offline(world: World) -> None:
    w, s = world, world.stack
    gone = s.raw(w.owner)
    machine_id = s.machine_of(w.owner, gone.session_id)
    gone.close()
    wait_until(lambda: not next(m for m in s.machines(w.owner) if m["id"] == machine_id)["online"], timeout=30,
               what="machine offline")
    accepted = len(w.first.accepted()) + len(w.second.accepted())
    response = s.chat(w.owner.api_key, {**SELF, PIN: machine_id})
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == "machine_offline"
    assert response.headers["retry-after"] == "30"
    assert len(w.first.accepted()) + len(w.second.accepted()) == accepted  # not served by the other two


def test_pin_is_kept_on_retry(world: World) -> None:
    """The pinned machine dies before its first token: the retry does not move to the owner's other
    (idle, online) machines; the request fails with the pinned machine's state."""
    w, s = world, world.stack
    doomed = s.node("doomed", w.owner, upstream=w.upstream, first_token_delay=30)
    try:
        machine_id = s.machine_of(w.owner, doomed.session_id)
        accepted = len(w.first.accepted()) + len(w.second.accepted())
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(s.chat, w.owner.api_key, {**SELF, PIN: machine_id})
            wait_accepted(doomed, future)
            doomed.kill()
            response = future.result()
        assert response.status_code == 503, response.text
        assert error_of(response)["code"] == "machine_offline"
        assert len(w.first.accepted()) + len(w.second.accepted()) == accepted
    finally:
        doomed.stop()


def test_pin_with_prefer_header_is_refused_even_for_an_owner(world: World) -> None:
    w, s = world, world.stack
    response = s.chat(w.owner.api_key, {**PREFER, PIN: s.machine_of(w.owner, w.first.session_id)})
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == PIN
