"""Pulling by catalog id through a real coordinator (`--catalog` naming the test Hub's repo), and
`serve` resolving models from the store: `--pull`, and the exit 1 that names the pull."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.provider.models.conftest import BUNDLED_NAME, MIRROR, ONE, Node, failed, pulled
from tests.support.accounts import create_account, login_node, wait_model_listed
from tests.support.hub_server import HubServer
from tests.support.processes import Coordinator, darkbloom_cmd, free_port, spawn, sqlite_coordinator

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def weight_hash(gguf: Path) -> str:
    with gguf.open("rb") as fh:
        return "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory, gguf: Path, weight_hash: str) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("catalog")
    source = {"repo": ONE, "file": BUNDLED_NAME}
    prices = {"input_price": 1000, "output_price": 1000}
    pinned = {**prices, "source": source, "weight_hash": weight_hash, "size_bytes": gguf.stat().st_size}
    catalog = {"models": [
        {"id": "smollm2-135m", "input_price": 50_000, "output_price": 200_000},
        {"id": "smol-catalog", "aliases": ["smol-alias"], **pinned, "context_length": 2048},
        {"id": "smol-served", **pinned},
        {"id": "smol-unpinned", **prices, "source": source},
        {"id": "smol-wrong-hash", **pinned, "weight_hash": "sha256:" + "0" * 64},
        {"id": "smol-huge", **prices, "source": source, "size_bytes": 10 ** 18},
        {"id": "no-source", **prices},
    ]}
    (root / "catalog.json").write_text(json.dumps(catalog))
    with sqlite_coordinator(root, "--catalog", str(root / "catalog.json")) as coord:
        yield coord


def test_a_catalog_id_is_pulled_from_its_source_under_its_id(node: Node, hub: HubServer, coordinator: Coordinator,
                                                             weight_hash: str) -> None:
    (node.home / "provider.toml").write_text(f'[coordinator]\nurl = "{coordinator.base_url}"\n')
    model_id, path = pulled(node.run("models", "pull", "smol-catalog"))
    assert (model_id, path) == ("smol-catalog", node.store / "smol-catalog" / BUNDLED_NAME)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert (manifest["weight_hash"], manifest["catalog"], manifest["source"]["repo"]) == (
        weight_hash, coordinator.base_url, ONE)
    # an alias names the same entry: the weights are already there
    assert pulled(node.run("models", "pull", "smol-alias")) == ("smol-catalog", path)
    assert len(hub.downloads()) == 1

    pulled(node.run("models", "pull", f"{MIRROR}:smollm2-135m-q4_1.gguf", "--as", "not-in-catalog"))
    listing = node.run("models", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    assert {row["id"]: row["in_catalog"] for row in json.loads(listing.stdout)} == {
        "smollm2-135m": True, "smol-catalog": True, "not-in-catalog": False}


def test_the_flag_and_the_environment_name_the_coordinator(node: Node, hub: HubServer,
                                                           coordinator: Coordinator) -> None:
    assert pulled(node.run("models", "pull", "smol-unpinned", "--coordinator", coordinator.base_url))[0] == \
        "smol-unpinned"
    assert pulled(node.run("models", "pull", "smol-served", DARKBLOOM_COORDINATOR=coordinator.api_url))[0] == \
        "smol-served"


def test_weights_the_hub_announces_with_another_hash_are_not_downloaded(node: Node, hub: HubServer,
                                                                       coordinator: Coordinator) -> None:
    line = failed(node.run("models", "pull", "smol-wrong-hash", "--coordinator", coordinator.base_url))
    assert "not the catalog's weight_hash sha256:0000" in line
    assert hub.downloads() == [] and node.entries() == []


def test_downloaded_bytes_with_another_hash_are_deleted(node: Node, hub: HubServer, coordinator: Coordinator,
                                                        weight_hash: str) -> None:
    hub.corrupt = True  # the Hub announces the right sha256; the bytes that arrive are not those
    line = failed(node.run("models", "pull", "smol-catalog", "--coordinator", coordinator.base_url))
    assert f"differs from the catalog's weight_hash {weight_hash}" in line and "the file was deleted" in line
    assert len(hub.downloads()) == 1 and node.entries() == [] and node.partials() == []


def test_a_model_larger_than_the_free_disk_is_refused_before_the_hub_is_asked(
        node: Node, hub: HubServer, coordinator: Coordinator) -> None:
    line = failed(node.run("models", "pull", "smol-huge", "--coordinator", coordinator.base_url))
    assert "not enough disk space for smol-huge: it needs 1000000000.00 GB more" in line
    assert hub.requests == [] and node.entries() == []


@pytest.mark.parametrize(("args", "cause"), [
    (["nope"], "has no model 'nope' (it lists: smollm2-135m, smol-catalog"),
    (["no-source"], "catalog model 'no-source' names no source for its weights"),
    (["smol-catalog", "--as", "mine"], "'smol-catalog' is a catalog id"),
    (["smollm2-135m"], "'smollm2-135m' is the bundled model"),
])
def test_what_the_catalog_cannot_give_exits_1(node: Node, hub: HubServer, coordinator: Coordinator,
                                             args: list[str], cause: str) -> None:
    assert cause in failed(node.run("models", "pull", *args, "--coordinator", coordinator.base_url))
    assert hub.requests == [] and node.entries() == []


def test_without_a_reachable_coordinator_a_catalog_id_cannot_be_pulled(node: Node) -> None:
    assert "no coordinator to look 'smol-catalog' up in" in failed(node.run("models", "pull", "smol-catalog"))
    down = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach the coordinator at {down}" in failed(
        node.run("models", "pull", "smol-catalog", "--coordinator", down))


def test_serving_a_model_the_store_lacks_names_the_pull(node: Node, coordinator: Coordinator) -> None:
    for command in ("serve", "start"):
        line = failed(node.run(command, "--coordinator", coordinator.base_url, "--model", "smol-served"))
        assert "model 'smol-served' is not in the model store" in line
        assert "`darkbloom models pull smol-served`" in line
    (node.home / "provider.toml").write_text(
        f'[coordinator]\nurl = "{coordinator.base_url}"\n\n[[models]]\nid = "smol-served"\npath = ""\n')
    assert "`darkbloom models pull smol-served`" in failed(node.run("serve"))
    assert "has no model 'nope'" in failed(node.run("serve", "--model", "nope", "--pull"))
    assert node.entries() == []


def test_serve_pull_fetches_a_catalog_model_then_serves_it(node: Node, hub: HubServer,
                                                           coordinator: Coordinator) -> None:
    owner = create_account(coordinator, credit_micro_usd=10_000_000)
    login_node(coordinator, node.home, owner)
    process = spawn(darkbloom_cmd("serve", "--coordinator", coordinator.base_url, "--model", "smol-served",
                                  "--pull", "--max-concurrency", "1"), node.home, "node.log", env=node.env)
    try:
        try:
            wait_model_listed(coordinator, owner, "smol-served")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nnode log:\n{process.log()[-4000:]}") from None
        assert "pulling smol-served" in process.log()
        assert node.entries() == ["smol-served"]
        # the catalog pins the weights: only a node advertising their sha256 is given the request
        answer = httpx.post(coordinator.api_url + "/chat/completions", headers=owner.headers(), timeout=120, json={
            "model": "smol-served", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "smol-served"
    finally:
        process.stop()
    assert len(hub.downloads()) == 1
