"""The model store's layout and guards, and how the node's config resolves a model id from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from darkbloom.provider.config import ConfigError, ModelNotPulled, load_config
from darkbloom.provider.model_store import InvalidModelId, Manifest, ModelStore, NotInStore, SymlinkInStore, \
    WeightOrigin, check_model_id
from darkbloom.provider.runner import _serve_args

HASH = "sha256:" + "ab" * 32


def install(store: ModelStore, model_id: str, content: bytes = b"GGUF weights", file: str = "m.Q4_0.gguf") -> Path:
    download = store.root / ".partial" / "download"
    download.parent.mkdir(parents=True, exist_ok=True)
    download.write_bytes(content)
    manifest = Manifest(id=model_id, file=file, size_bytes=len(content), weight_hash=HASH,
                        source=WeightOrigin(repo="o/r", file=file))
    return store.install(download, manifest).path


@pytest.mark.parametrize("model_id", ["llama-3.1-8b-instruct", "Qwen2.5:7b", "a", "x" * 256, "model.q4_k_m"])
def test_model_ids_the_store_holds(model_id: str) -> None:
    assert check_model_id(model_id) == model_id


@pytest.mark.parametrize("model_id", ["", "x" * 257, "a/b", "..", ".", ".partial", "a\\b", "tab\there", " pad",
                                      "smollm2-135m"])
def test_model_ids_the_store_refuses(model_id: str) -> None:
    with pytest.raises(InvalidModelId):
        check_model_id(model_id)


def test_install_writes_file_and_manifest_and_replaces_in_one_rename(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    first = install(store, "m", b"GGUF first")
    assert first == tmp_path / "models" / "m" / "m.Q4_0.gguf"
    manifest = json.loads((first.parent / "manifest.json").read_text())
    assert manifest["id"] == "m" and manifest["weight_hash"] == HASH and manifest["pulled_at"].endswith("+00:00")
    second = install(store, "m", b"GGUF second", file="other.gguf")
    assert second.read_bytes() == b"GGUF second" and not first.exists()
    assert [m.id for m in store.models()] == ["m"]
    assert sorted(p.name for p in (tmp_path / "models" / ".partial").iterdir()) == []


def test_an_entry_without_its_manifest_or_file_is_not_a_model(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    path = install(store, "m")
    path.unlink()
    assert store.get("m") is None
    (tmp_path / "models" / "half").mkdir()
    (tmp_path / "models" / "half" / "x.gguf").write_bytes(b"GGUF")
    assert store.get("half") is None and store.models() == []


def test_a_symlink_out_of_the_store_is_neither_served_nor_removed(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    outside = install(ModelStore(tmp_path / "elsewhere"), "m")
    store.root.mkdir(parents=True)
    (store.root / "m").symlink_to(outside.parent)
    assert store.get("m") is None and store.models() == []
    with pytest.raises(NotInStore):
        store.remove("m")
    assert outside.is_file()


def test_a_store_on_another_disk_may_be_a_symlink_but_nothing_below_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "disk" / "models"
    (elsewhere / ".partial" / "m").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(elsewhere)
    store = ModelStore(tmp_path / "home")
    store.refuse_symlinks("m")
    (elsewhere / ".partial" / "m" / "x.incomplete").symlink_to(tmp_path / "missing")
    with pytest.raises(SymlinkInStore, match=r"/home/models/\.partial/m/x\.incomplete is a symlink"):
        store.refuse_symlinks("m")


def test_remove_deletes_the_entry_only(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    kept, gone = install(store, "kept"), install(store, "gone")
    assert store.remove("gone").path == gone
    assert not gone.parent.exists() and kept.is_file()
    with pytest.raises(NotInStore):
        store.remove("gone")


def test_the_config_serves_a_pulled_id_from_the_store(home: Path) -> None:
    path = install(ModelStore(home), "pulled")
    config = load_config(home, {"models": ["smollm2-135m", "pulled"]})
    assert [(m.id, m.path) for m in config.models][1] == ("pulled", str(path))
    # `start` hands the background `serve` the file itself
    args = _serve_args(config)
    assert args[args.index(f"pulled={path.resolve()}") - 1] == "--model"


def test_a_missing_id_names_the_pull_that_fetches_it(home: Path) -> None:
    with pytest.raises(ModelNotPulled) as raised:
        load_config(home, {"models": ["smollm2-135m", "llama-x", "qwen-y"]})
    assert raised.value.model_ids == ["llama-x", "qwen-y"]
    assert "`darkbloom models pull llama-x`" in str(raised.value) and "models pull qwen-y" in str(raised.value)
    assert raised.value.config.model_ids == ["smollm2-135m", "llama-x", "qwen-y"]


def test_an_id_the_store_cannot_hold_is_a_config_error(home: Path) -> None:
    with pytest.raises(ConfigError, match="models pull owner/name") as raised:
        load_config(home, {"models": ["org/model"]})
    assert not isinstance(raised.value, ModelNotPulled)


def test_the_openai_backend_keeps_upstream_names(home: Path) -> None:
    config = load_config(home, {"backend": "openai", "upstream_url": "http://127.0.0.1:1", "models": ["llama3:8b"]})
    assert [(m.id, m.path) for m in config.models] == [("llama3:8b", "")]
