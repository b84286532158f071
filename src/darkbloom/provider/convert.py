"""`darkbloom models convert ID --to mlx`: a GGUF model of the store, or the bundled one, converted
(provider/mlx_convert.py) into an MLX model directory and installed in the store under a new id in
one rename, under the store's pull lock (docs/models.md "Converting a GGUF model to MLX")."""

from __future__ import annotations

import errno
import importlib
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from darkbloom.provider.bundled_model import BundledModelMissing, bundled_gguf_path
from darkbloom.provider.mlx_model import files_bytes, manifest_hash
from darkbloom.provider.model_store import MLX_DIR_NAME, InvalidModelId, Manifest, ModelStore, StoredModel, \
    NoRoom, StoreBusy, SymlinkInStore, check_model_id, size_text
from darkbloom.provider.models import HASH_CACHE_NAME, quantization_of, record_weight_hash, weight_hash
from darkbloom.wire.catalog import BUNDLED_MODEL_ID

if TYPE_CHECKING:
    from darkbloom.provider.mlx_convert import GgufModel

FORMATS = ("mlx",)
DEFAULT_DTYPE = "bfloat16"
MLX_EXTRA = ("numpy", "gguf", "safetensors", "tokenizers")  # what the conversion imports
_ROOM_MARGIN = 64 << 20  # the tokenizer files and the safetensors header, generously


class ConvertError(Exception):
    """A conversion that cannot go on; the message is one line naming the cause."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def convert_into_store(model_id: str, store: ModelStore, *, as_id: str | None = None, dtype: str = DEFAULT_DTYPE,
                       progress: TextIO = sys.stderr) -> StoredModel:
    """Convert the GGUF model `model_id` (of the store, or the bundled one) to an MLX model stored as
    `as_id` (default `ID-mlx`), replacing a model of that id. Nothing is left behind on failure, and no
    symlink under the store is followed. Raises ConvertError."""
    try:
        return _convert(model_id, store, as_id if as_id is not None else f"{model_id}-mlx", dtype, progress)
    except KeyboardInterrupt:
        raise ConvertError(f"conversion of {model_id} interrupted; nothing was kept", exit_code=130) from None


def _convert(model_id: str, store: ModelStore, new_id: str, dtype: str, progress: TextIO) -> StoredModel:
    _require_mlx_extra()
    from darkbloom.provider.mlx_convert import DTYPES, ConversionError

    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}", exit_code=2)
    gguf_path, gguf_hash = _source(model_id, store)
    if new_id == model_id:
        raise ConvertError(f"--as {new_id!r} is the model being converted; choose another id")
    try:
        check_model_id(new_id)
        store.refuse_symlinks(new_id)
        with store.writing():
            return _convert_locked(model_id, gguf_path, gguf_hash, new_id, store, dtype, progress)
    except (InvalidModelId, SymlinkInStore, StoreBusy, NoRoom, ConversionError) as exc:
        raise ConvertError(str(exc)) from None


def _require_mlx_extra() -> None:
    for module in MLX_EXTRA:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConvertError(f"converting to MLX needs the mlx extra: pip install 'darkbloom[mlx]' ({module} "
                               "cannot be imported)") from None


def _source(model_id: str, store: ModelStore) -> tuple[Path, str]:
    """The GGUF file `model_id` names and its sha256 (`sha256:…`)."""
    if model_id == BUNDLED_MODEL_ID:
        try:
            path = bundled_gguf_path().resolve()
        except BundledModelMissing as exc:
            raise ConvertError(str(exc)) from None
        return path, weight_hash(path, store.home / HASH_CACHE_NAME)
    try:
        stored = store.get(model_id)
    except InvalidModelId:
        stored = None
    if stored is None:
        raise ConvertError(f"model {model_id!r} is not in the model store {store.root} (nor the bundled "
                           f"{BUNDLED_MODEL_ID}): pull its GGUF first with `darkbloom models pull`; "
                           "`darkbloom models list` shows what is there")
    if stored.format != "gguf":
        raise ConvertError(f"{model_id!r} is already an MLX model; serve it as it is")
    return stored.path, stored.manifest.weight_hash


def _convert_locked(model_id: str, gguf_path: Path, gguf_hash: str, new_id: str, store: ModelStore, dtype: str,
                    progress: TextIO) -> StoredModel:
    from darkbloom.provider.mlx_convert import GgufModel

    started = time.monotonic()
    gguf = GgufModel(gguf_path)
    store.check_room(new_id, gguf.weights_bytes(dtype) + _ROOM_MARGIN)
    existing = store.get(new_id)
    if existing is not None:
        _say(progress, f"{new_id} is in the model store already ({existing.format}): the conversion replaces it")
    _say(progress, f"converting {model_id} ({_describe(gguf_path, gguf)}) to MLX {dtype} "
                   f"({size_text(gguf.weights_bytes(dtype))})…")
    partial_dir = store.partial_dir(new_id)
    out_dir = partial_dir / MLX_DIR_NAME
    try:
        shutil.rmtree(out_dir, ignore_errors=True)  # an earlier conversion's, stopped halfway: the lock is ours
        _write(gguf, out_dir, dtype, store, new_id)
        digest = manifest_hash(out_dir)
        manifest = Manifest(id=new_id, format="mlx", file=MLX_DIR_NAME, size_bytes=files_bytes(out_dir),
                            weight_hash=digest, source=None, converted_from=f"{model_id} {gguf_hash}")
        stored = store.install(out_dir, manifest)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        _remove_if_empty(partial_dir)
    record_weight_hash(stored.path.resolve(), digest, store.home / HASH_CACHE_NAME)
    took = time.monotonic() - started
    _say(progress, f"converted to {new_id}: {size_text(stored.manifest.size_bytes)} in {took:.1f} s")
    return stored


def _write(gguf: GgufModel, out_dir: Path, dtype: str, store: ModelStore, new_id: str) -> None:
    try:
        gguf.write_mlx(out_dir, dtype=dtype)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ConvertError(f"not enough disk space for {new_id} in {store.root}: the disk filled up while "
                               "converting; nothing was kept") from None
        raise ConvertError(f"cannot write {exc.filename or out_dir}: {exc.strerror or exc}") from None



def _describe(gguf_path: Path, gguf: GgufModel) -> str:
    quantization = quantization_of(gguf_path, gguf.metadata)
    size = size_text(gguf_path.stat().st_size)
    return f"{quantization}, {size}" if quantization else size


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass  # absent, or holding a pull's partial download of the same id



def _say(progress: TextIO, line: str) -> None:
    progress.write(line + "\n")
    progress.flush()
