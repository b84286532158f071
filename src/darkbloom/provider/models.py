"""What this node serves: model ids, files, sizes, weight hashes, quantization, context length."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

from darkbloom.paths import darkbloom_home
from darkbloom.provider import mlx_model
from darkbloom.wire.protocol import ModelInfo
from darkbloom.provider.config import ProviderConfig, resolve_model_path

log = logging.getLogger(__name__)

HASH_CACHE_NAME = "weight_hashes.json"
_QUANT_RE = re.compile(r"(?:^|[.\-_])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=\.gguf$|[.\-])", re.IGNORECASE)
# llama.cpp's `general.file_type` values (enum llama_ftype) for the common quantizations.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def describe_models(config: ProviderConfig, home: Path | None = None) -> list[tuple[ModelInfo, Path | None]]:
    """ModelInfo for each configured model, with its file (None for the openai backend)."""
    if config.backend == "openai":
        return [(ModelInfo(id=spec.id), None) for spec in config.models]
    cache_path = (home or darkbloom_home()) / HASH_CACHE_NAME
    out: list[tuple[ModelInfo, Path | None]] = []
    for spec in config.models:
        path = resolve_model_path(spec).resolve()
        if path.is_dir():  # an MLX model
            mlx_config = mlx_model.read_config(path)
            size, trained_context = mlx_model.weights_bytes(path), mlx_model.context_length(mlx_config)
            quantization = mlx_model.quantization(mlx_config)
        else:
            metadata = read_gguf_metadata(path)
            size, trained_context = path.stat().st_size, _context_length(metadata)
            quantization = quantization_of(path, metadata)
        served_context = min(config.context_length, trained_context) if trained_context else config.context_length
        info = ModelInfo(id=spec.id, size_bytes=size, weight_hash=weight_hash(path, cache_path),
                         quantization=quantization, context_length=served_context)
        out.append((info, path))
    return out


def weight_hash(path: Path, cache_path: Path) -> str:
    """sha256 of a GGUF file, or the manifest hash of an MLX model directory (`mlx_model`), cached by
    path + size + mtime (of every file, for a directory) so large weights are hashed once."""
    key = _cache_key(path)
    cache = _read_cache(cache_path)
    if isinstance(cache.get(key), str):
        return str(cache[key])
    log.info("hashing %s, once", path)
    if path.is_dir():
        digest = mlx_model.manifest_hash(path)
    else:
        with path.open("rb") as fh:
            digest = "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
    _write_cache(cache_path, cache, path, key, digest)
    return digest


def record_weight_hash(path: Path, digest: str, cache_path: Path) -> None:
    """Remember a hash computed elsewhere (a pull checks the file it installs), so that serving the
    file does not hash it again."""
    _write_cache(cache_path, _read_cache(cache_path), path, _cache_key(path), digest)


def _cache_key(path: Path) -> str:
    if path.is_dir():
        return f"{path}|{mlx_model.fingerprint(path)}"
    stat = path.stat()
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def _write_cache(cache_path: Path, cache: dict[str, Any], path: Path, key: str, digest: str) -> None:
    cache = {k: v for k, v in cache.items() if not k.startswith(f"{path}|")}
    cache[key] = digest
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(cache_path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, cache_path)
    except OSError as exc:
        log.warning("cannot write the weight hash cache %s: %s", cache_path, exc)


def _read_cache(cache_path: Path) -> dict[str, Any]:
    try:
        data = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def quantization_of(path: Path, metadata: dict[str, Any]) -> str:
    match = _QUANT_RE.search(path.name)
    if match:
        return match.group(1).upper()
    file_type = metadata.get("general.file_type")
    return _FILE_TYPES.get(file_type, "") if isinstance(file_type, int) else ""


def _context_length(metadata: dict[str, Any]) -> int:
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.context_length") if isinstance(arch, str) else None
    return value if isinstance(value, int) else 0


# A minimal GGUF reader: only the key/value header, arrays skipped (no tensor data is read).

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar key/values of a GGUF file's header; {} for a file that is not GGUF."""
    try:
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                return {}
            version, = struct.unpack("<I", fh.read(4))
            if version < 2:
                return {}
            _tensors, kv_count = struct.unpack("<QQ", fh.read(16))
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = _read_string(fh)
                value_type, = struct.unpack("<I", fh.read(4))
                metadata[key] = _read_value(fh, value_type)
            return metadata
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        log.warning("cannot read GGUF metadata from %s: %s", path, exc)
        return {}


def _read_string(fh: BinaryIO) -> str:
    length, = struct.unpack("<Q", fh.read(8))
    if length > 1 << 24:
        raise ValueError("GGUF string too long")
    return fh.read(length).decode("utf-8")


def _read_value(fh: BinaryIO, value_type: int) -> Any:
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]
    if value_type == _STRING:
        return _read_string(fh)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", fh.read(12))
        if item_type in _SCALARS:
            fh.seek(struct.calcsize(_SCALARS[item_type]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _read_value(fh, item_type)
        return None  # arrays (vocabularies, merges) are not needed
    raise ValueError(f"unknown GGUF value type {value_type}")
