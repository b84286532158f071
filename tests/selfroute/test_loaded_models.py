"""Loaded models shape placement (issue 22, docs/routing.md "Selection"): scripted provider sessions
say at registration which models they have in memory, then in every heartbeat; public requests go
to the session that has the model loaded, and follow it when the heartbeats change; an owner's own
machine without the model loaded still serves their exclusive and prefer requests (the node loads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pytest

from tests.selfroute.support import MODEL, PREFER, SELF, Stack
from tests.support.accounts import Account
from tests.support.processes import wait_until
from tests.support.raw_provider import ThreadedRaw

pytestmark = pytest.mark.e2e

CREDIT = 10_000_000


@dataclass
class World:
    stack: Stack
    payer: Account
    host: Account
    cold: ThreadedRaw   # registered with nothing loaded
    warm: ThreadedRaw   # registered with the model loaded


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    stack = Stack.start(tmp_path_factory.mktemp("loaded-models"), "--min-trust", "self_signed",
                        replicated=replicated)
    try:
        host = stack.account()
        cold = stack.raw(host, answer="from the cold one", loaded=())
        warm = stack.raw(host, answer="from the warm one", loaded=(MODEL,))
        for raw in (cold, warm):
            stack.wait_listed(host, raw.session_id)
        yield World(stack, stack.account(credit=CREDIT), host, cold, warm)
    finally:
        stack.close()


def served_by(w: World) -> str:
    response = w.stack.chat(w.payer.api_key)
    assert response.status_code == 200, response.text
    return str(response.headers["x-provider-id"])


def test_requests_go_to_the_session_with_the_model_loaded(world: World) -> None:
    w = world
    assert {served_by(w) for _ in range(4)} == {w.warm.session_id}
    assert w.cold.requests == []


def test_they_follow_the_heartbeats(world: World) -> None:
    w = world
    w.warm.report_loaded(())        # it unloaded the model (idle past its keep-alive) …
    w.cold.report_loaded((MODEL,))  # … and the other one loaded it
    wait_until(lambda: served_by(w) == w.cold.session_id, timeout=30, interval=0.05, what="the newly loaded one")
    assert {served_by(w) for _ in range(3)} == {w.cold.session_id}
    w.cold.report_loaded(())  # neither has it now: either may load it
    wait_until(lambda: served_by(w) == w.warm.session_id, timeout=30, interval=0.05, what="either")


def test_an_owner_is_never_refused_for_a_model_not_loaded(world: World) -> None:
    w, s = world, world.stack
    owner = s.account(credit=CREDIT)
    mine = s.raw(owner, answer="from my machine", loaded=())
    s.wait_listed(owner, mine.session_id)
    w.warm.report_loaded((MODEL,))
    for headers in (SELF, PREFER):
        response = s.chat(owner.api_key, headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == mine.session_id
        assert response.json()["choices"][0]["message"]["content"] == "from my machine"
    assert len(mine.requests) == 2
