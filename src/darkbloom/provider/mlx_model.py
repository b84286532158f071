"""An MLX model directory — safetensors weights, `config.json`, tokenizer files — as the node sees it
without loading it: its files, their manifest hash, the bytes its weights take, the KV cache a context
needs, its quantization and context length. Nothing here imports MLX."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
WEIGHTS_SUFFIX = ".safetensors"
KV_BYTES_PER_VALUE = 2  # mlx-lm keeps its KV cache in the model's float16/bfloat16 activations


class NotAnMlxModel(ValueError):
    """A directory that does not hold an MLX model; the message says what is missing."""


def model_files(directory: Path) -> list[str]:
    """Every regular file below `directory`, as relative POSIX paths in sorted order (symlinks and
    hidden entries — the Hub client's `.cache` — left out)."""
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or path.is_symlink() or not path.is_file():
            continue
        found.append(relative.as_posix())
    return sorted(found)


def manifest_text(directory: Path) -> str:
    """One line per file, `PATH SHA256HEX\\n`, in path order: what the weight hash is the sha256 of."""
    lines = []
    for name in model_files(directory):
        with (directory / name).open("rb") as fh:
            lines.append(f"{name} {hashlib.file_digest(fh, 'sha256').hexdigest()}\n")
    return "".join(lines)


def manifest_hash(directory: Path) -> str:
    """`sha256:` of the directory's manifest (`manifest_text`)."""
    return "sha256:" + hashlib.sha256(manifest_text(directory).encode()).hexdigest()


def fingerprint(directory: Path) -> str:
    """Changes when any file is added, removed, resized or rewritten (the hash cache's key)."""
    parts = []
    for name in model_files(directory):
        stat = (directory / name).stat()
        parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def read_config(directory: Path) -> dict[str, Any]:
    """The model's `config.json`; raises NotAnMlxModel when there is none or no weights beside it."""
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise NotAnMlxModel(f"{directory} has no {CONFIG_NAME}: it is not an MLX model directory") from None
    except (OSError, ValueError) as exc:
        raise NotAnMlxModel(f"{directory / CONFIG_NAME} cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise NotAnMlxModel(f"{directory / CONFIG_NAME} is not a JSON object")
    if not any(name.endswith(WEIGHTS_SUFFIX) for name in model_files(directory)):
        raise NotAnMlxModel(f"{directory} has no {WEIGHTS_SUFFIX} weights: it is not an MLX model directory")
    return config


def weights_bytes(directory: Path) -> int:
    """The bytes of the model's safetensors files (what loading maps into memory)."""
    return sum((directory / name).stat().st_size for name in model_files(directory) if name.endswith(WEIGHTS_SUFFIX))


def files_bytes(directory: Path) -> int:
    return sum((directory / name).stat().st_size for name in model_files(directory))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's numbers in `text_config`."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def kv_cache_bytes(config: dict[str, Any], n_ctx: int) -> int:
    """The KV cache of one sequence of `n_ctx` tokens: keys and values of every layer's KV heads."""
    config = _text_config(config)
    layers = _int(config.get("num_hidden_layers"))
    heads = _int(config.get("num_attention_heads"))
    kv_heads = _int(config.get("num_key_value_heads")) or heads
    head_dim = _int(config.get("head_dim")) or (_int(config.get("hidden_size")) // heads if heads else 0)
    return 2 * layers * kv_heads * head_dim * n_ctx * KV_BYTES_PER_VALUE


def context_length(config: dict[str, Any]) -> int:
    return _int(_text_config(config).get("max_position_embeddings"))


def quantization(config: dict[str, Any]) -> str:
    """`4bit`, `8bit`… for a quantized model, else its weights' dtype (`BF16`, `F16`, `F32`), or ''."""
    quantized = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantized, dict) and _int(quantized.get("bits")):
        return f"{_int(quantized.get('bits'))}bit"
    dtype = config.get("torch_dtype") or config.get("dtype")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dtype), "")


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
