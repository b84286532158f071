"""`darkbloom models pull owner/name` of an MLX repo, as a process against the Hub look-alike: a real
MLX model (the bundled GGUF converted) downloaded file by file, resumed, checked against the Hub's
sha256s and the catalog's manifest hash, listed and removed."""

from __future__ import annotations

import filecmp
import hashlib
import json
import signal
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from darkbloom.provider import pull
from tests.provider.models.conftest import BUNDLED_NAME, Node, failed, pulled
from tests.support.hub_server import HubServer, Seen
from tests.support.mlx_model import converted_smollm2, manifest_hash_of
from tests.support.processes import Coordinator, free_port, sqlite_coordinator, wait_until

MLX = "mlx-community/SmolLM2-135M-Instruct-bf16"  # the converted model, a README and files no model needs
MLX_ID = "smollm2-135m-instruct-bf16"  # the repo's name, lower-cased
TINY = "test-org/Tiny-MLX"  # a stand-in the pull cannot tell from a model: config, weights, tokenizer
MIXED = "test-org/mixed"  # an MLX model and a GGUF file
NO_MODEL = "test-org/no-model"  # a config and a README, no weights
UP = "test-org/mlx-up"  # TINY's files and two named like paths out of the repo
BACKSLASH = "test-org/mlx-backslash"  # TINY's files and weights whose name holds a backslash
TINY_FILES: dict[str, Path | bytes] = {
    "config.json": b'{"model_type": "llama", "num_hidden_layers": 1}',
    "model.safetensors": b"".join(hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(2048)),
    "tokenizer.json": b'{"model": {"type": "BPE"}}'}


@pytest.fixture(scope="session")
def mlx_dir() -> Path:
    return converted_smollm2()


@pytest.fixture
def hub(gguf: Path, mlx_dir: Path) -> Iterator[HubServer]:
    model: dict[str, Path | bytes] = {path.name: path for path in mlx_dir.iterdir()}
    with HubServer({
        MLX: {**model, "README.md": b"# SmolLM2 135M, MLX\n", ".gitattributes": b"*.safetensors filter=lfs\n",
              "original/params.json": b"{}", "convert.py": b"print('never run')\n"},
        TINY: TINY_FILES,
        MIXED: {**TINY_FILES, BUNDLED_NAME: gguf},
        NO_MODEL: {"config.json": b"{}", "README.md": b"# nothing\n"},
        UP: {**TINY_FILES, "../evil.safetensors": b"evil" * 2000, "..\\evil.safetensors": b"evil" * 2001},
        BACKSLASH: {**TINY_FILES, "a\\evil.safetensors": b"evil" * 2000},
    }) as server:
        yield server


def files_of(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def partial_files(node: Node, model_id: str) -> list[Path]:
    """What a pull of `model_id` keeps in progress: `.partial/ID/KEY/NAME[.incomplete]`."""
    return sorted(path for path in (node.store / ".partial" / model_id).glob("*/*") if path.is_file())


def asked_for(hub: HubServer, name: str, since: int = 0) -> list[Seen]:
    """The Hub's resolve requests (HEAD and GET) of a file, from request number `since` on."""
    return [seen for seen in hub.requests[since:] if "/resolve/" in seen.path and seen.path.endswith("/" + name)]


def test_an_mlx_repo_is_pulled_checked_listed_and_removed(node: Node, hub: HubServer, mlx_dir: Path) -> None:
    result = node.run("models", "pull", MLX)
    model_id, path = pulled(result)
    assert (model_id, path) == (MLX_ID, node.store / MLX_ID / "mlx")
    size = sum(p.stat().st_size for p in mlx_dir.iterdir())
    assert f"pulling {MLX_ID}: {MLX} at main (4 files, {size / 1e6:.1f} MB)" in result.stderr
    # exactly the model's files: no README, no git or Hub client files, nothing from a folder, no code
    assert files_of(path) == files_of(mlx_dir) == ["config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json"]
    assert all(filecmp.cmp(path / name, mlx_dir / name, shallow=False) for name in files_of(mlx_dir))
    weight_hash = manifest_hash_of(mlx_dir)
    manifest = json.loads((node.store / MLX_ID / "manifest.json").read_text())
    assert {key: manifest[key] for key in ("id", "format", "file", "size_bytes", "weight_hash", "catalog")} == {
        "id": MLX_ID, "format": "mlx", "file": "mlx", "size_bytes": size, "weight_hash": weight_hash,
        "catalog": None}
    assert manifest["source"] == {"repo": MLX, "file": "", "revision": "main", "commit": hub.commit(MLX)}
    assert not (node.store / ".partial" / MLX_ID).exists()
    assert weight_hash in json.loads((node.home / "weight_hashes.json").read_text()).values()
    assert not node.hf_home.exists() or not any(node.hf_home.rglob("*"))
    # the weights come from the CDN, the small files from the Hub, each at the commit the listing named
    assert [seen.path for seen in hub.downloads()] == [f"/cdn/{hub.file(MLX, 'model.safetensors').sha256}"]
    assert {seen.path for seen in hub.requests if "/resolve/" in seen.path} == {
        f"/{MLX}/resolve/{hub.commit(MLX)}/{name}" for name in files_of(mlx_dir)}

    seen = len(hub.requests)
    again = node.run("models", "pull", MLX)
    assert pulled(again) == (model_id, path) and "already in the model store" in again.stderr
    assert [s.path.split("/")[-1] for s in hub.requests[seen:]] == ["main", "main"]  # two listings, no file

    listing = node.run("models", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    row = {row["id"]: row for row in json.loads(listing.stdout)}[MLX_ID]
    assert row == {"id": MLX_ID, "source": "store", "file": str(path), "size_bytes": size,
                   "weight_hash": weight_hash, "configured": False, "in_catalog": None}
    removed = node.run("models", "rm", MLX_ID)
    assert removed.returncode == 0, removed.stderr
    assert node.entries() == [] and not (node.store / MLX_ID).exists()


def test_a_connection_cut_mid_file_is_resumed_with_a_range(node: Node, hub: HubServer, mlx_dir: Path) -> None:
    size = (mlx_dir / "model.safetensors").stat().st_size
    hub.cut_after = 100_000_000
    _, path = pulled(node.run("models", "pull", MLX))
    assert filecmp.cmp(path / "model.safetensors", mlx_dir / "model.safetensors", shallow=False)
    first, second = hub.downloads()
    assert (first.range, first.sent) == (None, 100_000_000)
    assert second.range is not None and second.range.startswith("bytes=")
    resumed_at = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 100_000_000 and second.sent == size - resumed_at


def test_a_stalled_pull_fails_and_the_next_one_resumes_where_it_stopped(node: Node, hub: HubServer,
                                                                       mlx_dir: Path) -> None:
    size = (mlx_dir / "model.safetensors").stat().st_size
    stall = 55 << 20
    hub.stall_after = stall  # every download of the weights stops there and never closes
    line = failed(node.run("models", "pull", MLX, HF_HUB_DOWNLOAD_TIMEOUT="1"))
    assert "stalled: nothing arrived for 1 s" in line and "run the same command again to resume" in line
    kept = {path.name: path.stat().st_size for path in partial_files(node, MLX_ID)}
    assert kept.keys() == {"config.json", "model.safetensors.incomplete"}  # in order: config, then the weights
    held = kept["model.safetensors.incomplete"]
    assert 40 << 20 <= held < stall and node.entries() == []

    hub.release()
    seen = len(hub.requests)
    result = node.run("models", "pull", MLX)
    _, path = pulled(result)
    assert "resuming at" in result.stderr
    assert all(filecmp.cmp(path / name, mlx_dir / name, shallow=False) for name in files_of(mlx_dir))
    [last] = [s for s in hub.downloads() if hub.requests.index(s) >= seen]
    assert (last.range, last.sent) == (f"bytes={held}-", size - held)
    assert asked_for(hub, "config.json", since=seen) == []  # finished in the first run: not asked for again
    # the weights went out once, but for what the first run's attempts received past what it kept
    assert size < sum(s.sent for s in hub.downloads()) <= size + 6 * (stall - held)


def test_bytes_that_differ_from_the_hubs_sha256_are_deleted_and_fetched_again(node: Node, hub: HubServer) -> None:
    hub.corrupt = True  # the weights (from the CDN) arrive with one byte changed
    line = failed(node.run("models", "pull", TINY))
    sha256 = hub.file(TINY, "model.safetensors").sha256
    assert f"the downloaded model.safetensors's sha256 sha256:" in line
    assert f"differs from the Hub's sha256 sha256:{sha256}; it was deleted" in line
    assert node.entries() == []
    assert [path.name for path in partial_files(node, "tiny-mlx")] == ["config.json", "tokenizer.json"]

    hub.corrupt = False
    seen = len(hub.requests)
    model_id, path = pulled(node.run("models", "pull", TINY))
    assert model_id == "tiny-mlx"
    assert {name: (path / name).read_bytes() for name in files_of(path)} == TINY_FILES
    # only the file that was deleted is asked for again
    assert [(s.method, s.path.split("/")[-1]) for s in hub.requests[seen:]] == [
        ("GET", "main"), ("GET", "main"), ("HEAD", "model.safetensors"),
        ("GET", hub.file(TINY, "model.safetensors").sha256)]


def test_as_names_the_id_and_a_mixed_repo_gives_its_gguf(node: Node, hub: HubServer) -> None:
    assert pulled(node.run("models", "pull", TINY, "--as", "My-Tiny"))[0] == "My-Tiny"
    model_id, path = pulled(node.run("models", "pull", MIXED, "--file", BUNDLED_NAME))
    assert (model_id, path.name) == ("smollm2-135m-instruct.q4_1", BUNDLED_NAME)
    assert json.loads((path.parent / "manifest.json").read_text())["format"] == "gguf"
    # with no file named, a repo with one GGUF file pulls it rather than its MLX model
    again = node.run("models", "pull", MIXED)
    assert pulled(again) == (model_id, path) and "already in the model store" in again.stderr
    assert node.entries() == ["My-Tiny", model_id]


def test_files_named_like_paths_out_of_the_repo_are_not_part_of_the_model(node: Node, hub: HubServer,
                                                                         tmp_path: Path) -> None:
    # one is in a folder ('..'), the other hidden ('..\\' is no separator here): neither is a model file
    _, path = pulled(node.run("models", "pull", UP))
    assert files_of(path) == sorted(TINY_FILES)
    assert not any("evil" in seen.path for seen in hub.requests)
    assert not list(tmp_path.rglob("*evil*"))


@pytest.mark.parametrize(("args", "cause"), [
    ([NO_MODEL], "test-org/no-model at main holds no model a node serves: no .gguf file, and no MLX model"),
    ([BACKSLASH], "the Hub file 'a\\\\evil.safetensors' of test-org/mlx-backslash cannot be stored"),
    ([f"{MIXED}:config.json"], "'config.json' is not a .gguf file"),
    ([TINY, "--as", "../outside"], "must not contain '/'"),
    ([TINY, "--as", ".hidden"], "starting with a letter or digit"),
    ([TINY, "--as", "smollm2-135m"], "the bundled model's id"),
])
def test_what_cannot_be_pulled_exits_1_naming_the_cause(node: Node, hub: HubServer, tmp_path: Path,
                                                         args: list[str], cause: str) -> None:
    assert cause in failed(node.run("models", "pull", *args))
    assert node.entries() == [] and hub.downloads() == []
    assert not any("/resolve/" in seen.path for seen in hub.requests)
    assert not (node.home.parent / "outside").exists() and not list(tmp_path.rglob("*evil*"))


def test_a_hub_that_announces_no_sizes_is_not_downloaded_from(node: Node, hub: HubServer) -> None:
    assert hub._server is not None
    served = hub._server.RequestHandlerClass

    class NoSizes(served):  # type: ignore[valid-type,misc]
        def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
            if isinstance(body, dict) and "siblings" in body:
                body = {**body, "siblings": [{key: value for key, value in sibling.items()
                                              if key not in ("size", "lfs")} for sibling in body["siblings"]]}
            super()._json(status, body, headers)

    hub._server.RequestHandlerClass = NoSizes
    assert "announces no size for test-org/Tiny-MLX/config.json at main" in failed(node.run("models", "pull", TINY))
    assert not any("/resolve/" in seen.path for seen in hub.requests) and node.entries() == []


def key_of(hub: HubServer, repo: str) -> str:
    """The name a pull of `repo` gives its partial directory (pull_mlx._download_key: repo and commit)."""
    return hashlib.sha256(f"{repo}\n{hub.commit(repo)}".encode()).hexdigest()[:32]


@pytest.mark.parametrize("planted", ["tiny-mlx", ".partial/tiny-mlx/KEY", ".partial/tiny-mlx/KEY/config.json",
                                     ".partial/tiny-mlx/KEY/model.safetensors.incomplete"])
def test_a_symlink_planted_in_the_store_is_refused_and_never_followed(node: Node, hub: HubServer, tmp_path: Path,
                                                                       planted: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_bytes(TINY_FILES["config.json"])  # what the pull would take as finished
    link = node.store / planted.replace("KEY", key_of(hub, TINY))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "config.json" if "." in link.name else outside)
    assert f"{link} is a symlink" in failed(node.run("models", "pull", TINY))
    assert files_of(outside) == ["config.json"]
    assert (outside / "config.json").read_bytes() == TINY_FILES["config.json"]
    assert link.is_symlink() and hub.downloads() == [] and not (node.store / "tiny-mlx" / "mlx").exists()


def test_one_pull_at_a_time_and_an_interrupted_one_exits_130(node: Node, hub: HubServer) -> None:
    hub.stall_after = 16_000  # the weights stop there and wait
    node.env["HF_HUB_DOWNLOAD_TIMEOUT"] = "600"
    first = node.popen("models", "pull", TINY, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: first.poll() is not None or hub.stalled.is_set(), timeout=60, what="the stalled download")
        assert first.poll() is None, first.communicate()
        assert "another pull or conversion is running" in failed(node.run("models", "pull", UP))
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    finally:
        hub.release()
        first.kill()
        first.wait()
    assert first.returncode == 130, stderr
    assert b"pull of tiny-mlx interrupted at" in stderr and b"run the same command again to resume" in stderr
    assert node.entries() == []


# Pulled by catalog id, through a real coordinator whose catalog names MLX repos


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory, mlx_dir: Path) -> Iterator[Coordinator]:
    root = tmp_path_factory.mktemp("mlx-catalog")
    prices: dict[str, Any] = {"input_price": 1000, "output_price": 1000, "format": "mlx"}
    catalog = {"models": [
        {"id": "smol-mlx", **prices, "source": {"repo": MLX}, "weight_hash": manifest_hash_of(mlx_dir),
         "size_bytes": sum(p.stat().st_size for p in mlx_dir.iterdir())},
        {"id": "tiny-wrong-hash", **prices, "source": {"repo": TINY, "revision": "main"},
         "weight_hash": "sha256:" + "0" * 64},
        {"id": "tiny-wrong-size", **prices, "source": {"repo": TINY}, "size_bytes": 1},
    ]}
    (root / "catalog.json").write_text(json.dumps(catalog))
    with sqlite_coordinator(root, "--catalog", str(root / "catalog.json")) as coord:
        yield coord


@pytest.mark.e2e
def test_a_catalog_id_of_an_mlx_model_is_pulled_and_checked_against_its_pin(
        node: Node, hub: HubServer, coordinator: Coordinator, mlx_dir: Path) -> None:
    served = httpx.get(coordinator.api_url + "/models/catalog", timeout=10).json()["data"]
    entry = {model["id"]: model for model in served}["smol-mlx"]
    assert (entry["format"], entry["source"]) == ("mlx", {"repo": MLX, "revision": "main"})

    model_id, path = pulled(node.run("models", "pull", "smol-mlx", "--coordinator", coordinator.base_url))
    assert (model_id, path) == ("smol-mlx", node.store / "smol-mlx" / "mlx")
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert (manifest["format"], manifest["weight_hash"], manifest["catalog"]) == (
        "mlx", manifest_hash_of(mlx_dir), coordinator.base_url)
    again = node.run("models", "pull", "smol-mlx", "--coordinator", coordinator.base_url)
    assert pulled(again) == (model_id, path) and "already in the model store" in again.stderr
    assert len(hub.downloads()) == 1


@pytest.mark.e2e
def test_an_mlx_model_with_another_manifest_hash_is_deleted(node: Node, hub: HubServer,
                                                            coordinator: Coordinator) -> None:
    line = failed(node.run("models", "pull", "tiny-wrong-hash", "--coordinator", coordinator.base_url))
    assert "the downloaded model's manifest hash sha256:" in line
    assert f"differs from the catalog's weight_hash sha256:{'0' * 64}; the download was deleted" in line
    assert len(hub.downloads()) == 1 and node.entries() == [] and partial_files(node, "tiny-wrong-hash") == []

    line = failed(node.run("models", "pull", "tiny-wrong-size", "--coordinator", coordinator.base_url))
    assert f"{TINY} at main on the Hub is" in line and "not the catalog's size_bytes 1; nothing was downloaded" in line
    assert len(hub.downloads()) == 1 and node.entries() == []


def test_a_catalog_entry_the_node_cannot_read_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    prices = {"input_price": 1, "output_price": 1}
    entries = [{"id": "a", **prices, "format": "mlx", "source": {"repo": "o/a", "revision": "main"}},
               {"id": "b", **prices, "format": "gguf-v9", "source": {"repo": "o/b"}},  # a newer coordinator's
               {"id": "c", **prices, "source": {"repo": "o/c", "file": "c.gguf"}, "a_newer_field": 1}]
    monkeypatch.setattr(pull.httpx, "get", lambda url, timeout: httpx.Response(200, json={"data": entries}))
    catalog = pull.fetch_catalog("http://coordinator.test")
    assert [model.id for model in catalog.models] == ["a", "c"]
    target = pull.catalog_target("a", catalog, "http://coordinator.test")
    assert (target.format, target.repo, target.file, target.describe()) == ("mlx", "o/a", "", "o/a at main")
    assert pull.catalog_target("c", catalog, "http://coordinator.test").format == "gguf"


@pytest.mark.e2e
def test_a_pulled_mlx_model_is_served_by_id(node: Node, hub: HubServer, mlx_dir: Path) -> None:
    """The converted model, pulled from the Hub like any MLX repo, is what `--backend mlx` serves by id:
    the node advertises the pull's manifest hash and answers as the converted model does."""
    model_id, _ = pulled(node.run("models", "pull", MLX))
    started = node.run("start", "--local", "--port", str(free_port()), "--backend", "mlx", "--model", model_id)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        local = wait_until(lambda: (node.home / "local.json").is_file() and
                           json.loads((node.home / "local.json").read_text()), timeout=120, what="local.json")
        headers = {"Authorization": f"Bearer {local['api_key']}"}
        answer = httpx.post(local["base_url"] + "/chat/completions", headers=headers, timeout=120, json={
            "model": model_id, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].startswith("The capital of France is Paris")
        listed = node.run("models", "list", "--json", "--backend", "mlx", "--model", model_id)
        [entry] = [m for m in json.loads(listed.stdout) if m["id"] == model_id]
        assert entry["weight_hash"] == manifest_hash_of(mlx_dir) and entry["configured"]
    finally:
        stopped = node.run("stop")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
