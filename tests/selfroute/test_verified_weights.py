"""Verified weights and context length with real nodes (issue 22, docs/models.md "Verified weights"
and "Context length").

The module's catalog pins `smollm2-135m` to the sha256 of the bundled GGUF. One node serves the
bundled file (the verified weights); another, linked to the owner, serves a copy with bytes appended
under the same id (other weights). Public requests only ever reach the first; the owner still gets
answers from their own machine (exclusive and prefer), which lists the model in `unverified_models`;
an admin's catalog change applies to the machines already connected. A request longer than every
context it could use is refused before anything is reserved or counted; one with more bytes than
the context has tokens, but fewer tokens, is served.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from darkbloom.provider.bundled_model import bundled_gguf_path
from tests.selfroute.support import MODEL, PREFER, SELF, Node, Stack, error_of
from tests.support.accounts import Account

pytestmark = pytest.mark.e2e

CREDIT = 10_000_000
TOO_LONG = 100_000  # max_tokens beyond any context the nodes serve (capped at the catalog's 8192, still too long)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


@dataclass
class World:
    stack: Stack
    catalog: dict[str, Any]
    owner: Account       # the other weights' machine is theirs
    host: Account        # the verified machine's owner
    verified: Node
    other: Node
    other_hash: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("verified-weights")
    bundled = bundled_gguf_path()
    copy = root / "other-weights.gguf"
    shutil.copyfile(bundled, copy)
    with copy.open("ab") as file:
        file.write(b"\0" * 64)  # the same model to llama.cpp, other weights to a hash
    catalog = {"models": [{"id": MODEL, "input_price": 50_000, "output_price": 200_000, "max_output_tokens": 8192,
                           "weight_hash": sha256_of(bundled)}]}
    (root / "catalog.json").write_text(json.dumps(catalog))
    stack = Stack.start(root, "--catalog", str(root / "catalog.json"), "--min-trust", "self_signed",
                        replicated=replicated)
    try:
        owner, host = stack.account(credit=CREDIT), stack.account()
        verified = stack.node("verified", host, models=(MODEL,))
        other = stack.node("other", owner, models=(f"{MODEL}={copy}",))
        stack.wait_listed(owner, other.session_id)
        stack.wait_listed(host, verified.session_id)
        yield World(stack, catalog, owner, host, verified, other, sha256_of(copy))
    finally:
        stack.close()


def test_public_requests_reach_only_the_verified_weights(world: World) -> None:
    w, s = world, world.stack
    stranger = s.account(credit=CREDIT)
    for token in (stranger.api_key, w.owner.api_key):  # the owner too, when not self-routing
        for _ in range(3):
            response = s.chat(token)
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == w.verified.session_id
            assert response.headers["x-darkbloom-routed"] == "fleet"
        assert [m["id"] for m in s.get("/models", token).json()["data"]] == [MODEL]
    assert w.other.accepted() == []


def test_the_owner_is_served_by_its_own_machine_for_free(world: World) -> None:
    w, s = world, world.stack
    before = s.balance(w.owner)
    for headers in (SELF, PREFER):
        response = s.chat(w.owner.api_key, headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        assert response.headers["x-provider-id"] == w.other.session_id
        assert (response.headers["x-darkbloom-routed"], response.headers["x-darkbloom-billing"]) == ("owned", "free")
    assert s.balance(w.owner) == before  # prefer reserved, then refunded all of it
    newest = s.usage(w.owner)[:2]
    assert [(row["self_routed"], row["cost_micro_usd"], row["routed"]) for row in newest] == [(True, 0, "owned")] * 2
    assert [m["id"] for m in s.get("/models", w.owner.api_key, SELF).json()["data"]] == [MODEL]
    assert s.get("/me/self-route-models", w.owner.api_key).json()["models"] == [MODEL]
    assert len(w.other.accepted()) == 2


def test_the_machine_lists_its_unverified_models(world: World) -> None:
    w, s = world, world.stack
    mine, = s.machines(w.owner)
    assert (mine["session_id"], mine["models"], mine["unverified_models"]) == (w.other.session_id, [MODEL], [MODEL])
    hosts, = s.machines(w.host)
    assert (hosts["session_id"], hosts["unverified_models"]) == (w.verified.session_id, [])


def test_a_catalog_change_applies_to_the_machines_connected(world: World) -> None:
    """The admin pins the other file's hash: the roles swap at once, for routing and for the lists."""
    w, s = world, world.stack
    admin = s.consumer_side
    swapped = json.loads(json.dumps(w.catalog))
    swapped["models"][0]["weight_hash"] = w.other_hash
    stranger = s.account(credit=CREDIT)
    try:
        httpx.put(admin.api_url + "/admin/catalog", json=swapped, headers=admin.admin()).raise_for_status()
        for _ in range(3):
            response = s.chat(stranger.api_key)
            assert response.status_code == 200, response.text
            assert response.headers["x-provider-id"] == w.other.session_id
        assert s.machines(w.owner)[0]["unverified_models"] == []
        assert s.machines(w.host)[0]["unverified_models"] == [MODEL]
        response = s.chat(w.host.api_key, SELF)  # the host's own request still reaches its machine
        assert response.status_code == 200 and response.headers["x-provider-id"] == w.verified.session_id
    finally:
        httpx.put(admin.api_url + "/admin/catalog", json=w.catalog, headers=admin.admin()).raise_for_status()
    response = s.chat(stranger.api_key)
    assert response.status_code == 200 and response.headers["x-provider-id"] == w.verified.session_id


def test_a_request_longer_than_every_context_is_refused_before_anything_is_taken(world: World) -> None:
    w, s = world, world.stack
    payer = s.account(credit=CREDIT)
    key = s.key(payer, rpm_limit=4)  # each refused request counts against RPM: three of them, then one served
    long_prompt = [{"role": "user", "content": "lighthouse " * 8000}]  # 88,000 bytes: ~22,000 tokens estimated
    for fields in ({"max_tokens": TOO_LONG}, {"messages": long_prompt}, {"max_tokens": TOO_LONG, "stream": True}):
        response = s.chat(key, **fields)
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                                  "messages")
        assert response.headers["x-should-retry"] == "false"
    assert s.balance(payer) == CREDIT and s.usage(payer) == []
    broke = s.account()  # no credit: refused for its length, not asked to pay (no reservation came first)
    assert error_of(s.chat(broke.api_key, max_tokens=TOO_LONG))["code"] == "context_length_exceeded"
    mine = s.chat(w.owner.api_key, SELF, max_tokens=TOO_LONG)  # the owner's own machine has no longer context
    assert mine.status_code == 400 and error_of(mine)["code"] == "context_length_exceeded"
    # more bytes than the context has tokens, but far fewer tokens: served (the key's fourth request)
    response = s.chat(key, messages=[{"role": "user", "content": "lighthouse " * 300 + "Say yes."}])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] < 2048 < 3300
    assert [row["request_id"] for row in s.usage(payer)] == [response.headers["x-request-id"]]
