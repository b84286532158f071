"""A node configured for MLX, before anything is loaded: which models `--backend mlx` accepts (MLX
directories, by path or from the model store), what it reports of them (size, manifest hash,
quantization, context) and the memory it says they need."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from darkbloom.provider.config import ConfigError, load_config
from darkbloom.provider.memory_fit import CHAT_BUFFERS, ModelDoesNotFit, estimate, refuse_unfit_models
from darkbloom.provider.mlx_model import kv_cache_bytes, manifest_hash, manifest_text, model_files, weights_bytes
from darkbloom.provider.model_store import MLX_DIR_NAME, Manifest, ModelStore
from darkbloom.provider.models import describe_models
from tests.support.mlx_model import converted_smollm2


@pytest.fixture(scope="module")
def mlx_dir() -> Path:
    return converted_smollm2()


def stored_mlx(home: Path, source: Path, model_id: str) -> Path:
    """`source` installed in the store of `home` as the MLX model `model_id`."""
    copy = home / "copy"
    shutil.copytree(source, copy)
    stored = ModelStore(home).install(copy, Manifest(id=model_id, format="mlx", file=MLX_DIR_NAME,
                                                     size_bytes=weights_bytes(copy),
                                                     weight_hash=manifest_hash(copy)))
    return stored.path


def test_the_manifest_hash_is_the_sha256_of_one_line_per_file(mlx_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(mlx_dir, model)
    (model / ".cache").mkdir()
    (model / ".cache" / "leftover").write_text("the Hub client's bookkeeping")
    (model / "sub").mkdir()
    (model / "sub" / "extra.json").write_text("{}")
    lines = []
    for name in sorted(["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                        "sub/extra.json"]):
        lines.append(f"{name} {hashlib.sha256((model / name).read_bytes()).hexdigest()}\n")
    assert model_files(model) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                         "tokenizer_config.json", "sub/extra.json"])
    assert manifest_text(model) == "".join(lines)
    assert manifest_hash(model) == "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()
    (model / "sub" / "extra.json").write_text("{ }")
    assert manifest_hash(model) != "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def test_a_directory_is_served_and_described(home: Path, mlx_dir: Path) -> None:
    (home / "provider.toml").write_text("[backend]\ncontext_length = 4096\n")
    config = load_config(home, {"backend": "mlx", "models": [f"mine={mlx_dir}"]})
    [(info, path)] = describe_models(config, home)
    assert path == mlx_dir.resolve()
    assert info.id == "mine" and info.size_bytes == weights_bytes(mlx_dir)
    assert info.weight_hash == manifest_hash(mlx_dir)
    assert info.quantization == "BF16" and info.context_length == 4096  # below the model's 8,192


def test_a_stored_mlx_model_is_served_by_id(home: Path, mlx_dir: Path) -> None:
    path = stored_mlx(home, mlx_dir, "smollm2-135m-mlx")
    config = load_config(home, {"backend": "mlx", "models": ["smollm2-135m-mlx"]})
    assert Path(config.models[0].path) == path
    with pytest.raises(ConfigError, match="is an MLX model, which the llama-cpp backend does not serve: serve it "
                                          "with --backend mlx"):
        load_config(home, {"models": ["smollm2-135m-mlx"]})


def test_the_bundled_gguf_is_not_an_mlx_model(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"convert it with `darkbloom models convert smollm2-135m --to mlx`"):
        load_config(home, {"backend": "mlx"})


def test_a_missing_or_non_directory_path_is_refused(home: Path, gguf: Path) -> None:
    for path in (home / "nowhere", gguf):
        with pytest.raises(ConfigError, match="model directory for 'x' not found"):
            load_config(home, {"backend": "mlx", "models": [f"x={path}"]})


def test_a_pulled_gguf_is_refused_by_the_mlx_backend(home: Path, gguf: Path) -> None:
    copy = home / "copy.gguf"
    shutil.copy(gguf, copy)
    ModelStore(home).install(copy, Manifest(id="ggufmodel", file="copy.gguf", size_bytes=copy.stat().st_size,
                                            weight_hash="sha256:" + "0" * 64))
    with pytest.raises(ConfigError, match="convert it: darkbloom models convert ggufmodel --to mlx"):
        load_config(home, {"backend": "mlx", "models": ["ggufmodel"]})


def test_the_memory_need_is_the_weights_and_a_kv_cache_per_window(mlx_dir: Path) -> None:
    config = json.loads((mlx_dir / "config.json").read_text())
    need = estimate("m", mlx_dir, 2048, 4)
    # 30 layers × 3 KV heads × 64 dims, keys and values, 16 bits: 23,040 bytes a token
    assert kv_cache_bytes(config, 1) == 2 * 30 * 3 * 64 * 2
    assert need.file_bytes == weights_bytes(mlx_dir) and need.sequences == 4
    assert need.context_bytes == kv_cache_bytes(config, 2048) * 4 + CHAT_BUFFERS


def test_a_model_that_cannot_fit_stops_the_node(home: Path, mlx_dir: Path) -> None:
    config = load_config(home, {"backend": "mlx", "models": [f"mine={mlx_dir}"], "max_memory_gb": 0.1})
    with pytest.raises(ModelDoesNotFit, match="model mine needs"):
        refuse_unfit_models(config)


def test_nothing_of_mlx_is_imported_unless_the_backend_is_chosen(home: Path) -> None:
    """A llama.cpp node (and the CLI, and the model store) runs without MLX installed: none of its code
    imports MLX, mlx-lm or the converter's libraries until --backend mlx or `models convert` asks."""
    script = f"""
import sys
from pathlib import Path
import darkbloom.cli, darkbloom.provider.node, darkbloom.provider.pull, darkbloom.provider.servable
from darkbloom.provider.backends import create_backend
from darkbloom.provider.config import load_config
backend = create_backend(load_config(Path({str(home)!r}), {{}}))
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("mlx", "mlx_lm", "gguf", "transformers"))
print(type(backend).__name__, loaded)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DARKBLOOM_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["LlamaCppBackend", "[]"]
