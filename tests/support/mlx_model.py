"""The bundled SmolLM2-135M converted to MLX once for the whole suite: a directory under the user's
cache, named by the dtype, the GGUF's sha256 and the converter's source, so a new GGUF or a changed
converter converts again. xdist workers (and parallel runs) convert it once, under a file lock; the
directory is written beside its place and renamed into it, so no reader sees half of it. A conversion
unused for a week is deleted when a new one is made."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from darkbloom.provider import mlx_convert
from darkbloom.provider.bundled_model import bundled_gguf_path

UNUSED_FOR = 7 * 24 * 3600  # seconds


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "darkbloom-tests"


def converted_smollm2(dtype: str = "bfloat16") -> Path:
    """The MLX model directory of the bundled GGUF in `dtype`, converted on the first call anywhere."""
    gguf = bundled_gguf_path()
    target = cache_root() / f"smollm2-135m-mlx-{dtype}-{_sha256(gguf)[:12]}-{_converter_version()}"
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not target.is_dir():
                _drop_unused(target.parent)
                scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
                try:
                    mlx_convert.convert_gguf_to_mlx(gguf, scratch / "mlx", dtype=dtype)
                    os.rename(scratch / "mlx", target)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    os.utime(target)  # in use: _drop_unused keeps it
    return target


def _drop_unused(root: Path) -> None:
    """Conversions no test has asked for in a week (older converters', mostly), and their locks."""
    stale = time.time() - UNUSED_FOR
    for entry in root.glob("smollm2-135m-mlx-*"):
        if entry.is_dir() and entry.stat().st_mtime < stale:
            shutil.rmtree(entry, ignore_errors=True)
            Path(str(entry) + ".lock").unlink(missing_ok=True)


@functools.cache
def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@functools.cache
def _converter_version() -> str:
    """Changes with the converter's source: a cached conversion is never one an older converter wrote."""
    return "c" + hashlib.sha256(Path(mlx_convert.__file__).read_bytes()).hexdigest()[:8]


def manifest_hash_of(directory: Path) -> str:
    """`sha256:` of the lines `PATH SHA256HEX` of every file of a flat model directory, in path order:
    the weight hash of an MLX model, computed here on its own rather than by the code under test."""
    lines = []
    for name in sorted(path.name for path in directory.iterdir()):
        lines.append(f"{name} {hashlib.sha256((directory / name).read_bytes()).hexdigest()}\n")
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()
