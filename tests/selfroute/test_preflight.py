"""Exclusive self-route errors (the pre-flight table of docs/self-route.md "When your machine can't serve
(exclusive only)"): each one a named, actionable error,
never a fallback to the public fleet, never a charge.

Acceptance points 4, 5, 6, 7 and 8 of issue 5 (and the capability row of the table). The module's
coordinator waits at most 2 s in a model's queue. Another account's provider — a hand-driven socket
that records every request it is sent — serves the model to the public fleet throughout, so a
request that leaked to the fleet would show up there; after each refusal a paid public request
proves the socket still receives what is meant for it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.selfroute.support import (FIXED_ANSWER, MODEL, SELF, Stack, error_of, start_upstream,
                                     wait_accepted)
from tests.support.accounts import Account
from tests.support.raw_provider import ThreadedRaw
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

QUEUE_MAX_WAIT = 2


@dataclass
class World:
    stack: Stack
    upstream: str
    public: ThreadedRaw     # another account's machine in the public fleet
    payer: Account          # funded, owns nothing: sends the paid public probes


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("preflight")
    stack = Stack.start(root, "--queue-max-wait", str(QUEUE_MAX_WAIT), replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        stranger = stack.account(credit=0)
        public = stack.raw(stranger, answer="from the public fleet")
        payer = stack.account(credit=10_000_000)
        yield World(stack, url, public, payer)
    finally:
        stack.close()


def assert_public_untouched(w: World, seen_before: list[str]) -> None:
    """The public provider got nothing since ``seen_before``; a paid public request still reaches it."""
    assert w.public.requests == seen_before
    probe = w.stack.chat(w.payer.api_key)
    assert probe.status_code == 200, probe.text
    assert probe.headers["x-provider-id"] == w.public.session_id
    assert w.public.requests == [*seen_before, probe.headers["x-request-id"]]


def assert_nothing_billed(w: World, caller: Account, balance: int) -> None:
    assert w.stack.balance(caller) == balance
    assert w.stack.usage(caller) == []


# 4 ------------------------------------------------------------------------------------------------

def test_no_linked_machine(world: World) -> None:
    w, s = world, world.stack
    caller = s.account(credit=1_000_000)
    seen = list(w.public.requests)
    for stream in (False, True):
        response = s.chat(caller.api_key, SELF, stream=stream)
        assert response.status_code == 409, response.text
        error = error_of(response)
        assert error["type"] == error["code"] == "no_linked_machine"
        assert "darkbloom login" in error["message"]
        assert "retry-after" not in response.headers
    assert_nothing_billed(w, caller, 1_000_000)
    assert_public_untouched(w, seen)


# 5 ------------------------------------------------------------------------------------------------

def test_machine_linked_but_stopped(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=1_000_000)
    node = s.node("stopped", owner, upstream=w.upstream)
    served = s.chat(owner.api_key, SELF)  # it did serve while it ran
    assert served.status_code == 200 and served.headers["x-provider-id"] == node.session_id
    node.stop()
    wait_until(lambda: not any(m["online"] for m in s.machines(owner)), timeout=30, what="machine offline")
    seen = list(w.public.requests)
    response = s.chat(owner.api_key, SELF)
    assert response.status_code == 503, response.text
    error = error_of(response)
    assert error["type"] == error["code"] == "machine_offline"
    assert response.headers["retry-after"] == "30"
    assert "darkbloom serve" in error["message"]
    assert s.balance(owner) == 1_000_000
    assert len(s.usage(owner)) == 1  # only the request it served while running
    assert_public_untouched(w, seen)


# 6 ------------------------------------------------------------------------------------------------

def test_model_not_loaded(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=1_000_000)
    node = s.node("other-model", owner, upstream=w.upstream, models=("another-model",))
    try:
        seen = list(w.public.requests)
        response = s.chat(owner.api_key, SELF)  # asks for the catalog model MODEL, which it does not serve
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["type"] == error["code"] == "model_not_loaded"
        assert response.headers["retry-after"] == "15"
        assert MODEL in error["message"] and "darkbloom serve --model" in error["message"]
        assert node.accepted() == []
        assert_nothing_billed(w, owner, 1_000_000)
        assert_public_untouched(w, seen)  # its machine does not serve MODEL, so the probe cannot land there
        # the model it does load is served
        served = s.chat(owner.api_key, SELF, model="another-model")
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
    finally:
        node.stop()


# 7 ------------------------------------------------------------------------------------------------

def test_unverified_runtime_blocks_routing(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=1_000_000)
    machine = s.raw(owner, answer="must not be asked", runtime="sha256:" + "ab" * 32)
    try:
        seen = list(w.public.requests)
        response = s.chat(owner.api_key, SELF)
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["type"] == error["code"] == "model_routing_blocked"
        assert "runtime" in error["message"] and "verified" in error["message"]
        assert "challenge" not in error["message"]
        assert "retry-after" not in response.headers
        assert machine.requests == []
        assert_nothing_billed(w, owner, 1_000_000)
        assert_public_untouched(w, seen)
    finally:
        machine.close()


def test_stale_challenge_blocks_routing(tmp_path: Path, replicated: bool) -> None:
    """A coordinator whose challenges go stale 1 s after they pass (and re-challenges only every 300 s)."""
    s = Stack.start(tmp_path, "--challenge-freshness", "1", "--challenge-interval", "300", replicated=replicated)
    try:
        owner = s.account(credit=1_000_000)
        machine = s.raw(owner, answer="must not be asked")
        # the owner's model list names only what passes every gate now: the model leaves it once stale
        wait_until(lambda: MODEL not in s.get("/me/self-route-models", owner.api_key).json()["models"],
                   timeout=30, interval=0.05, what="the machine's challenge to go stale")
        response = s.chat(owner.api_key, SELF)
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["type"] == error["code"] == "model_routing_blocked"
        assert "attestation challenge" in error["message"]
        assert "runtime" not in error["message"]
        assert machine.requests == []
        assert s.balance(owner) == 1_000_000
        assert s.usage(owner) == []
    finally:
        s.close()


def test_capability_unsupported(world: World) -> None:
    s = world.stack
    owner = s.account(credit=0)
    machine = s.raw(owner, answer="text only")  # registers its model without vision
    try:
        image = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
        response = s.chat(owner.api_key, SELF, messages=image)
        assert response.status_code == 503, response.text
        error = error_of(response)
        assert error["type"] == "model_unavailable" and error["code"] == "model_capability_unsupported"
        assert machine.requests == []
        plain = s.chat(owner.api_key, SELF)
        assert plain.status_code == 200 and plain.headers["x-provider-id"] == machine.session_id
    finally:
        machine.close()


# 8 ------------------------------------------------------------------------------------------------

def test_busy_own_machine_gives_machine_busy_and_never_the_public_fleet(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=0)
    node = s.node("busy", owner, upstream=w.upstream, max_concurrency=1, first_token_delay=6)
    try:
        seen = list(w.public.requests)
        with ThreadPoolExecutor(1) as pool:
            long_one = pool.submit(s.chat, owner.api_key, SELF)
            wait_accepted(node, long_one)
            started = time.monotonic()
            response = s.chat(owner.api_key, SELF)
            waited = time.monotonic() - started
            assert response.status_code == 429, response.text
            error = error_of(response)
            assert error["type"] == error["code"] == "machine_busy"
            assert int(response.headers["retry-after"]) >= 1
            assert waited >= QUEUE_MAX_WAIT * 0.9  # it waited in the queue first (a lower bound only)
            assert w.public.requests == seen  # the idle public provider was never used
            first = long_one.result()
        assert first.status_code == 200, first.text
        assert first.headers["x-provider-id"] == node.session_id
        assert len(node.accepted()) == 1
        assert s.balance(owner) == 0
    finally:
        node.stop()
    # the owner's machine (public too) is gone: a paid probe must land on the public provider
    wait_until(lambda: not any(m["online"] for m in s.machines(owner)), timeout=30, what="machine offline")
    assert_public_untouched(w, seen)


def test_a_queued_exclusive_request_waits_for_the_owners_machine(world: World) -> None:
    """The owner's one slot frees within the queue wait: the queued request is placed on the owner's
    machine when the queue drains, never on the idle public provider."""
    w, s = world, world.stack
    owner = s.account(credit=0)
    node = s.node("queued", owner, upstream=w.upstream, max_concurrency=1, first_token_delay=1)
    try:
        seen = list(w.public.requests)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(s.chat, owner.api_key, SELF)
            wait_accepted(node, first)
            second = pool.submit(s.chat, owner.api_key, SELF)  # the slot is taken: it queues
            responses = [first.result(), second.result()]
        for response in responses:
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == node.session_id
            assert response.headers["x-darkbloom-billing"] == "free"
        assert sorted(node.accepted()) == sorted(r.headers["x-request-id"] for r in responses)
        assert w.public.requests == seen
    finally:
        node.stop()
    wait_until(lambda: not any(m["online"] for m in s.machines(owner)), timeout=30, what="machine offline")
