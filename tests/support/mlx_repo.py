"""A small but real MLX model for tests: the bundled GGUF converted to an MLX model directory
(`darkbloom.provider.mlx_convert`, bfloat16: about 270 MB, a few seconds) once per test session —
shared by its xdist workers through a file lock — and what a pull must compute from it."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

from darkbloom.provider.bundled_model import bundled_gguf_path

_NAME = "mlx-smollm2-135m-bf16"


def converted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's MLX directory: `config.json`, `model.safetensors`, `tokenizer.json`,
    `tokenizer_config.json`. Made on first use in the session's base temporary directory."""
    from darkbloom.provider.mlx_convert import convert_gguf_to_mlx

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the workers' common folder
    model = root / _NAME
    with FileLock(str(root / f"{_NAME}.lock")):
        if not model.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=f".{_NAME}-", dir=root))
            try:
                convert_gguf_to_mlx(bundled_gguf_path(), scratch / "model", dtype="bfloat16")
                os.replace(scratch / "model", model)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return model


def manifest_hash_of(directory: Path) -> str:
    """`sha256:` of the lines `PATH SHA256HEX` of every file of a flat model directory, in path order:
    the weight hash of an MLX model, computed here on its own rather than by the code under test."""
    lines = []
    for name in sorted(path.name for path in directory.iterdir()):
        lines.append(f"{name} {hashlib.sha256((directory / name).read_bytes()).hexdigest()}\n")
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()
