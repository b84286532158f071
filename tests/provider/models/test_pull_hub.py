"""`darkbloom models pull owner/name…`, `models list` and `models rm` as processes, against the Hub
look-alike: the real Hub client downloads the bundled GGUF, resumes it, and refuses what is wrong."""

from __future__ import annotations

import filecmp
import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.provider.models.conftest import BUNDLED_NAME, MIRROR, NOT_GGUF, ONE, TWO, Node, failed, pulled
from tests.support.hub_server import HubServer
from tests.support.processes import free_port, wait_until

DEFAULT_ID = "smollm2-135m-instruct.q4_1"  # the file's stem, lower-cased


def test_a_repo_with_one_gguf_is_pulled_checked_and_recorded(node: Node, hub: HubServer, gguf: Path) -> None:
    model_id, path = pulled(node.run("models", "pull", ONE))
    assert model_id == DEFAULT_ID
    assert path == node.store / DEFAULT_ID / BUNDLED_NAME
    assert filecmp.cmp(path, gguf, shallow=False)
    manifest = json.loads((path.parent / "manifest.json").read_text())
    weight_hash = "sha256:" + hub.file(ONE, BUNDLED_NAME).sha256
    assert manifest["id"] == DEFAULT_ID and manifest["file"] == BUNDLED_NAME
    assert manifest["source"] == {"repo": ONE, "file": BUNDLED_NAME, "revision": "main", "commit": hub.commit(ONE)}
    assert (manifest["weight_hash"], manifest["size_bytes"], manifest["catalog"]) == (weight_hash,
                                                                                    gguf.stat().st_size, None)
    assert node.partials() == []
    # the node will not hash the file again to advertise it
    assert weight_hash in json.loads((node.home / "weight_hashes.json").read_text()).values()
    # the Hub client left nothing in its own cache
    assert not node.hf_home.exists() or not any(node.hf_home.rglob("*"))
    assert [(seen.method, seen.path.split("/")[-1]) for seen in hub.requests] == [
        ("GET", "main"), ("HEAD", BUNDLED_NAME), ("GET", hub.file(ONE, BUNDLED_NAME).sha256)]

    again = node.run("models", "pull", ONE)
    assert pulled(again) == (model_id, path)
    assert "already in the model store" in again.stderr
    assert len(hub.downloads()) == 1


def test_a_file_is_named_inline_or_with_file_and_stored_under_as(node: Node, hub: HubServer) -> None:
    assert pulled(node.run("models", "pull", f"{MIRROR}:smollm2-135m-q4_1.gguf", "--as", "My-Smol"))[0] == "My-Smol"
    model_id, path = pulled(node.run("models", "pull", TWO, "--file", "model-copy.Q4_1.gguf"))
    assert (model_id, path.name) == ("model-copy.q4_1", "model-copy.Q4_1.gguf")
    assert node.entries() == ["My-Smol", "model-copy.q4_1"]


def test_a_repo_with_two_ggufs_exits_2_listing_them(node: Node, hub: HubServer) -> None:
    result = node.run("models", "pull", TWO)
    assert result.returncode == 2, result.stderr
    assert "--file" in result.stderr
    assert [line.strip() for line in result.stderr.splitlines()[1:]] == ["model-copy.Q4_1.gguf", "model.Q4_1.gguf"]
    assert node.entries() == [] and hub.downloads() == []


@pytest.mark.parametrize(("args", "cause"), [
    (["test-org/no-such-repo"], "repository test-org/no-such-repo not found"),
    ([f"{ONE}:missing.gguf"], "file 'missing.gguf' not found in test-org/SmolLM2-135M-GGUF"),
    ([ONE, "--revision", "v9"], "revision 'v9' not found"),
    ([f"{ONE}:README.md"], "'README.md' is not a .gguf file"),
    (["not a/repo"], "is not a Hub repo id"),
    ([ONE, "--as", "../outside"], "must not contain '/'"),
    ([ONE, "--as", ".hidden"], "starting with a letter or digit"),
    ([ONE, "--as", "x" * 257], "must be 1 to 256 characters"),
    ([ONE, "--as", "smollm2-135m"], "the bundled model's id"),
])
def test_what_cannot_be_pulled_exits_1_naming_the_cause(node: Node, hub: HubServer, args: list[str],
                                                         cause: str) -> None:
    assert cause in failed(node.run("models", "pull", *args))
    assert node.entries() == [] and hub.downloads() == []
    assert not (node.home.parent / "outside").exists()


def test_an_unreachable_hub_exits_1(node: Node) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach the Hub at {endpoint}" in failed(node.run("models", "pull", ONE, HF_ENDPOINT=endpoint))
    assert f"cannot reach the Hub at {endpoint}" in failed(
        node.run("models", "pull", f"{ONE}:{BUNDLED_NAME}", HF_ENDPOINT=endpoint))
    assert node.entries() == []


def test_a_file_that_is_not_gguf_is_deleted(node: Node, hub: HubServer) -> None:
    assert "is not a GGUF file" in failed(node.run("models", "pull", NOT_GGUF))
    assert node.entries() == [] and node.partials() == []


def test_bytes_that_differ_from_the_hubs_sha256_are_deleted(node: Node, hub: HubServer) -> None:
    hub.corrupt = True
    line = failed(node.run("models", "pull", ONE))
    assert "differs from the Hub's sha256" in line and "deleted" in line
    assert node.entries() == [] and node.partials() == []


def test_a_connection_cut_mid_file_is_resumed_with_a_range(node: Node, hub: HubServer, gguf: Path) -> None:
    size = gguf.stat().st_size
    hub.cut_after = 30_000_000
    _, path = pulled(node.run("models", "pull", ONE))
    assert filecmp.cmp(path, gguf, shallow=False)
    first, second = hub.downloads()
    assert (first.range, first.sent) == (None, 30_000_000)
    assert second.range is not None and second.range.startswith("bytes=")
    resumed_at = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 30_000_000 and second.sent == size - resumed_at


def test_an_interrupted_pull_resumes_where_it_stopped(node: Node, hub: HubServer, gguf: Path) -> None:
    size = gguf.stat().st_size
    hub.stall_after = 25 << 20  # the download stops there and waits
    node.env["HF_HUB_DOWNLOAD_TIMEOUT"] = "600"  # the Hub client does not give up and ask again: Ctrl-C ends it
    process = node.popen("models", "pull", ONE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: process.poll() is not None or (hub.stalled.is_set() and _partial_of(node, 20 << 20)),
                   timeout=120, what="the download held at 25 MiB, 20 MiB of it on disk")
        assert process.poll() is None, process.communicate()
        [partial] = _partial_of(node, 20 << 20)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert b"interrupted" in stderr and b"again to resume" in stderr
    kept = partial.stat().st_size
    assert kept >= 20 << 20 and node.entries() == []

    hub.release()
    _, path = pulled(node.run("models", "pull", ONE))
    assert filecmp.cmp(path, gguf, shallow=False)
    first, last = hub.downloads()
    assert (first.range, first.sent) == (None, 25 << 20)
    assert (last.range, last.sent) == (f"bytes={kept}-", size - kept)
    assert node.partials() == []


def test_a_download_that_stalls_is_given_up_in_one_line_and_resumed_later(node: Node, hub: HubServer,
                                                                         gguf: Path) -> None:
    hub.stall_after = 25 << 20  # every download stops there and never closes
    line = failed(node.run("models", "pull", ONE, HF_HUB_DOWNLOAD_TIMEOUT="1"))
    assert "stalled: nothing arrived for 1 s" in line and "run the same command again to resume" in line
    [partial] = node.partials()
    kept = partial.stat().st_size
    assert kept >= 20 << 20 and node.entries() == []
    # the Hub client asked again from what was on disk before it gave up
    assert len(hub.downloads()) > 1 and hub.downloads()[-1].range == f"bytes={kept}-"

    hub.release()
    _, path = pulled(node.run("models", "pull", ONE))
    assert filecmp.cmp(path, gguf, shallow=False)
    assert hub.downloads()[-1].range == f"bytes={kept}-"


def test_the_hub_token_goes_to_the_hub_never_to_the_cdn(node: Node, hub: HubServer) -> None:
    pulled(node.run("models", "pull", ONE, HF_TOKEN="hf_test_token_0123456789"))
    assert {(seen.method, seen.path.startswith("/cdn/"), seen.authorized) for seen in hub.requests} == {
        ("GET", False, True), ("HEAD", False, True), ("GET", True, False)}


def test_list_shows_bundled_pulled_and_configured_models_and_rm_removes(node: Node, hub: HubServer,
                                                                         gguf: Path) -> None:
    model_id, path = pulled(node.run("models", "pull", ONE))
    (node.home / "provider.toml").write_text(
        f'[coordinator]\nurl = "http://127.0.0.1:{free_port()}"\n\n'  # no coordinator there: catalog unknown
        '[[models]]\nid = "smollm2-135m"\npath = ""\n\n[[models]]\nid = "not-pulled-yet"\npath = ""\n')
    listing = node.run("models", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    rows = {row["id"]: row for row in json.loads(listing.stdout)}
    assert rows["smollm2-135m"] == {
        "id": "smollm2-135m", "source": "bundled", "file": str(gguf), "size_bytes": gguf.stat().st_size,
        "weight_hash": "sha256:" + hub.file(ONE, BUNDLED_NAME).sha256, "configured": True, "in_catalog": None}
    assert rows[model_id] == {**rows["smollm2-135m"], "id": model_id, "source": "store", "file": str(path),
                              "configured": False}
    assert rows["not-pulled-yet"] == {"id": "not-pulled-yet", "source": "store", "file": None, "size_bytes": None,
                                      "weight_hash": None, "configured": True, "in_catalog": None}
    table = node.run("models", "list", COLUMNS="250")
    assert table.returncode == 0 and "not pulled" in table.stdout and "unknown" in table.stdout

    removed = node.run("models", "rm", model_id)
    assert removed.returncode == 0, removed.stderr
    assert not path.parent.exists() and node.entries() == []
    assert f"model {model_id!r} is not in the model store" in failed(node.run("models", "rm", model_id))
    assert "the bundled model" in failed(node.run("models", "rm", "smollm2-135m"))
    assert gguf.is_file()


def test_rm_and_list_never_reach_outside_the_store(node: Node, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "weights.gguf").write_bytes(b"GGUF precious")
    (outside / "manifest.json").write_text(json.dumps({
        "id": "escape", "file": "weights.gguf", "size_bytes": 13, "weight_hash": "sha256:" + "0" * 64,
        "source": {"repo": "a/b", "file": "weights.gguf"}}))
    node.store.mkdir()
    (node.store / "escape").symlink_to(outside)
    assert "not in the model store" in failed(node.run("models", "rm", "escape"))
    assert "not in the model store" in failed(node.run("models", "rm", ".."))
    listing = node.run("models", "list", "--json")
    assert "escape" not in {row["id"] for row in json.loads(listing.stdout)}
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "weights.gguf"]


def test_two_pulls_into_one_store_do_not_interleave(node: Node, hub: HubServer) -> None:
    hub.stall_after = 25 << 20
    first = node.popen("models", "pull", ONE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: hub.downloads(), timeout=60, what="the first download")
        assert "another pull or conversion is running" in failed(
            node.run("models", "pull", TWO, "--file", "model.Q4_1.gguf"))
    finally:
        first.kill()
        first.wait()


def _partial_of(node: Node, at_least: int) -> list[Path]:
    return [p for p in node.partials() if p.stat().st_size >= at_least]
