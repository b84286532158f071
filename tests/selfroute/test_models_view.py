"""The owned-model view: `GET /v1/models` under an exclusive policy lists only the caller's own
machines' models (`owned_by: "self"` for models outside the catalog); without it those off-catalog
models are absent and unreachable. Also `GET /v1/me/self-route-models`.

Acceptance point 16 of issue 5. The owner's node runs llama.cpp on the bundled GGUF under two ids:
the catalog's `smollm2-135m` and an off-catalog `custom-name`. Another account's node serves the
catalog model and an off-catalog model of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pytest

from darkbloom.provider.bundled_model import bundled_gguf_path
from tests.selfroute.support import MODEL, SELF, Node, Stack, error_of, start_upstream, streamed_text
from tests.support.accounts import Account

pytestmark = pytest.mark.e2e

CUSTOM = "custom-name"
THEIRS = "their-secret"


@dataclass
class World:
    stack: Stack
    owner: Account
    mine: Node
    other: Account
    others_node: Node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("models-view")
    stack = Stack.start(root, replicated=replicated)
    try:
        upstream, url = start_upstream(root / "upstream")
        stack.processes.append(upstream)
        owner = stack.account(credit=0)
        other = stack.account(credit=10_000_000)
        gguf = bundled_gguf_path()
        mine = stack.node("mine", owner, models=(f"{CUSTOM}={gguf}", MODEL), max_concurrency=1)
        others_node = stack.node("others", other, upstream=url, models=(MODEL, THEIRS))
        yield World(stack, owner, mine, other, others_node)
    finally:
        stack.close()


def _models(s: Stack, token: str, headers: dict[str, str] | None = None) -> list[dict[str, object]]:
    response = s.get("/models", token, headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return list(body["data"])


def test_self_view_lists_only_own_models(world: World) -> None:
    w, s = world, world.stack
    listed = _models(s, w.owner.api_key, SELF)
    assert sorted((m["id"], m["owned_by"]) for m in listed) == [(CUSTOM, "self"), (MODEL, "darkbloom")]
    assert all(m["object"] == "model" for m in listed)
    # the same view for a self_route_only key without the header
    key = s.key(w.owner, self_route_only=True)
    assert sorted(m["id"] for m in _models(s, key)) == [CUSTOM, MODEL]
    # the other account sees its own machine's models, never the owner's
    theirs = _models(s, w.other.api_key, SELF)
    assert sorted((m["id"], m["owned_by"]) for m in theirs) == [(MODEL, "darkbloom"), (THEIRS, "self")]
    single = s.get(f"/models/{CUSTOM}", w.owner.api_key, SELF)
    assert single.status_code == 200 and single.json()["owned_by"] == "self"


def test_self_view_respects_allowed_models(world: World) -> None:
    s = world.stack
    key = s.key(world.owner, allowed_models=[MODEL])
    assert [m["id"] for m in _models(s, key, SELF)] == [MODEL]


def test_self_route_models_endpoint(world: World) -> None:
    w, s = world, world.stack
    assert s.get("/me/self-route-models", w.owner.api_key).json() == {"models": [CUSTOM, MODEL]}
    assert s.get("/me/self-route-models", w.other.api_key).json() == {"models": [MODEL, THEIRS]}
    assert s.get("/me/self-route-models", s.account().api_key).json() == {"models": []}


def test_off_catalog_models_are_absent_and_unreachable_without_the_header(world: World) -> None:
    w, s = world, world.stack
    mine_before = w.mine.accepted()
    stranger = s.account(credit=10_000_000)
    for token in (w.owner.api_key, w.other.api_key, stranger.api_key):
        ids = [m["id"] for m in _models(s, token)]
        assert ids == [MODEL]  # the public catalog; neither off-catalog model
        for model in (CUSTOM, THEIRS):
            single = s.get(f"/models/{model}", token)
            assert single.status_code == 404, single.text
            assert error_of(single)["code"] == "model_not_found"
            response = s.chat(token, model=model)
            assert response.status_code == 404, response.text
            assert error_of(response)["type"] == "model_not_found"
    # another account asking for the owner's model with `self` gets its own machine's state, not the owner's machine
    response = s.chat(w.other.api_key, SELF, model=CUSTOM)
    assert response.status_code == 503, response.text
    assert error_of(response)["code"] == "model_not_loaded"
    assert w.mine.accepted() == mine_before


def test_owner_reaches_the_off_catalog_model_with_self(world: World) -> None:
    w, s = world, world.stack
    response = s.chat(w.owner.api_key, SELF, model=CUSTOM, max_tokens=8)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == CUSTOM
    assert body["choices"][0]["message"]["content"]
    assert response.headers["x-provider-id"] == w.mine.session_id
    assert response.headers["x-darkbloom-billing"] == "free"
    streamed, text = s.stream(w.owner.api_key, SELF, model=CUSTOM, max_tokens=8)
    assert streamed.status_code == 200 and streamed_text(text)
    assert s.balance(w.owner) == 0
    rows = [r for r in s.usage(w.owner) if r["model"] == CUSTOM]
    assert len(rows) == 2 and all(r["cost_micro_usd"] == 0 and r["self_routed"] for r in rows)


def test_prefer_never_reaches_another_accounts_off_catalog_model(world: World) -> None:
    """A caller whose own machine advertises the same off-catalog name but cannot serve it (its
    runtime is not verified) asks with `prefer`: the other account's machine serving that name is
    not public fleet, so it must not be used."""
    w, s = world, world.stack
    caller = s.account(credit=10_000_000)
    blocked = s.raw(caller, models=(THEIRS,), runtime="sha256:" + "cd" * 32, answer="must not be asked")
    try:
        theirs_before = w.others_node.accepted()
        response = s.chat(caller.api_key, {"X-Darkbloom-Route": "prefer"}, model=THEIRS)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "model_routing_blocked"  # its own machine's state
        assert w.others_node.accepted() == theirs_before
        assert blocked.requests == []
        assert s.balance(caller) == 10_000_000
    finally:
        blocked.close()
