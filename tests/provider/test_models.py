from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from darkbloom.provider.config import load_config
from darkbloom.provider.models import HASH_CACHE_NAME, describe_models, read_gguf_metadata


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def tiny_gguf(path: Path, context_length: int, file_type: int) -> Path:
    """A GGUF header with three key/values (one an array to skip) and no tensors."""
    kvs = [
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama"),
        _gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _gguf_string("a") + _gguf_string("b"),
        _gguf_string("llama.context_length") + struct.pack("<II", 4, context_length),
        _gguf_string("general.file_type") + struct.pack("<II", 4, file_type),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return path


def test_bundled_model_is_described(home: Path, gguf: Path) -> None:
    [(info, path)] = describe_models(load_config(home, {}), home)
    assert path == gguf.resolve()
    assert info.id == "smollm2-135m"
    assert info.size_bytes == gguf.stat().st_size
    with gguf.open("rb") as fh:
        assert info.weight_hash == "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
    assert info.quantization == "Q4_1"
    assert info.context_length == 2048  # the served n_ctx, below the model's trained 8192


def test_gguf_header_is_read(tmp_path: Path, gguf: Path) -> None:
    metadata = read_gguf_metadata(gguf)
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.context_length"] == 8192
    assert read_gguf_metadata(tiny_gguf(tmp_path / "t.gguf", 512, 15))["llama.context_length"] == 512
    (tmp_path / "not.gguf").write_bytes(b"hello")
    assert read_gguf_metadata(tmp_path / "not.gguf") == {}


def test_quantization_falls_back_to_file_type_and_context_to_the_model(home: Path, tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "custom-model.gguf", 512, 15)
    [(info, _)] = describe_models(load_config(home, {"models": [f"custom={path}"]}), home)
    assert info.quantization == "Q4_K_M"
    assert info.context_length == 512


def test_weight_hash_is_cached_by_path_size_and_mtime(home: Path, tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "m.Q8_0.gguf", 256, 7)
    config = load_config(home, {"models": [f"m={path}"]})
    [(first, _)] = describe_models(config, home)
    cache_file = home / HASH_CACHE_NAME
    cache = json.loads(cache_file.read_text())
    [key] = cache
    assert cache[key] == first.weight_hash and key.startswith(str(path.resolve()))
    # A cached entry is trusted as long as path, size and mtime match …
    cache[key] = "sha256:from-the-cache"
    cache_file.write_text(json.dumps(cache))
    assert describe_models(config, home)[0][0].weight_hash == "sha256:from-the-cache"
    # … and a changed file is hashed again.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert describe_models(config, home)[0][0].weight_hash == first.weight_hash
    assert len(json.loads(cache_file.read_text())) == 1


def test_openai_models_have_no_file(home: Path) -> None:
    config = load_config(home, {"backend": "openai", "upstream_url": "http://127.0.0.1:1", "models": ["a", "b"]})
    described = describe_models(config, home)
    assert [(info.id, info.size_bytes, path) for info, path in described] == [("a", 0, None), ("b", 0, None)]
