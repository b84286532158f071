"""`private_only` provider mode (`darkbloom serve --private-only`, or `[coordinator] private_only =
true` in provider.toml): the machine serves only its owner's self-route requests; it is invisible in
the public `/v1/models` and never chosen for public requests.

Acceptance point 13 of issue 5. The module's coordinator routes self_signed machines publicly
(`--min-trust self_signed`), so without `private_only` these machines would be public.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import pytest

from tests.selfroute.support import MODEL, PREFER, SELF, Node, Stack, error_of, start_upstream
from tests.support.accounts import Account

pytestmark = pytest.mark.e2e

PRIVATE = "private-model"   # in the catalog, but only the private machines serve it
CREDIT = 10_000_000


@dataclass
class World:
    stack: Stack
    owner: Account
    flagged: Node      # --private-only
    configured: Node   # private_only = true in provider.toml
    public: Node       # another account's ordinary machine


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("private-only")
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [
        {"id": MODEL, "input_price": 50_000, "output_price": 200_000},
        {"id": PRIVATE, "input_price": 50_000, "output_price": 200_000}]}))
    stack = Stack.start(root, "--catalog", str(catalog), "--min-trust", "self_signed", replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=CREDIT)
        flagged = stack.node("flagged", owner, upstream=url, models=(MODEL, PRIVATE), extra=("--private-only",))
        (root / "configured").mkdir()
        (root / "configured" / "provider.toml").write_text("[coordinator]\nprivate_only = true\n")
        configured = stack.node("configured", owner, upstream=url, models=(PRIVATE,))
        public = stack.node("public", stack.account(), upstream=url, models=(MODEL,))
        yield World(stack, owner, flagged, configured, public)
    finally:
        stack.close()


def test_private_machines_are_listed_as_private_to_their_owner(world: World) -> None:
    w, s = world, world.stack
    machines = {m["session_id"]: m for m in s.machines(w.owner)}
    assert machines[w.flagged.session_id]["private_only"] is True
    assert machines[w.configured.session_id]["private_only"] is True


def test_invisible_in_public_models_and_routing(world: World) -> None:
    w, s = world, world.stack
    stranger = s.account(credit=CREDIT)
    for token in (stranger.api_key, w.owner.api_key):  # the owner too, when not self-routing
        assert [m["id"] for m in s.get("/models", token).json()["data"]] == [MODEL]
        assert s.get(f"/models/{PRIVATE}", token).status_code == 404
        response = s.chat(token, model=PRIVATE)
        assert response.status_code == 503, response.text
        assert error_of(response)["type"] == "model_unavailable"
    for _ in range(4):  # the catalog model goes to the public machine, never a private one
        response = s.chat(stranger.api_key)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == w.public.session_id
    assert w.flagged.accepted() == [] and w.configured.accepted() == []
    assert s.balance(w.owner) == CREDIT


def test_served_to_its_owner(world: World) -> None:
    w, s = world, world.stack
    before = s.balance(w.owner)
    private_sessions = {w.flagged.session_id, w.configured.session_id}
    for headers, model in ((SELF, PRIVATE), (PREFER, PRIVATE), (SELF, MODEL), (PREFER, MODEL)):
        response = s.chat(w.owner.api_key, headers, model=model)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] in private_sessions
        assert response.headers["x-darkbloom-routed"] == "owned"
        assert response.headers["x-darkbloom-billing"] == "free"
    assert s.balance(w.owner) == before
    listed = s.get("/models", w.owner.api_key, SELF).json()["data"]
    assert sorted(m["id"] for m in listed) == sorted([MODEL, PRIVATE])
