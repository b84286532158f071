"""The model store: pulled and converted models under `$DARKBLOOM_HOME/models/`, one directory per
model id with its weights — a GGUF file, or an MLX model directory named `mlx` — and its manifest
(docs/models.md "Pulling a model")."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from darkbloom.wire.protocol import model_id_problem
from darkbloom.wire.catalog import BUNDLED_MODEL_ID, MAX_MODEL_ID, WEIGHT_HASH_PATTERN

STORE_DIR = "models"
MANIFEST_NAME = "manifest.json"
PARTIAL_DIR = ".partial"  # downloads in progress, kept between runs so a pull resumes
GGUF_FILE_NAME = r"^[^/\\]+\.(?i:gguf)$"  # a stored file's name: no folder, something before the suffix
MLX_DIR_NAME = "mlx"  # an MLX model's directory (safetensors, config.json, tokenizer files) in its entry
WeightFormat = Literal["gguf", "mlx"]


class InvalidModelId(ValueError):
    """A name the store cannot hold as a model id; the message says why."""


class StoreBusy(Exception):
    """Another pull or conversion is writing into this store."""

    def __init__(self, root: Path) -> None:
        super().__init__(f"another pull or conversion is running in {root}; wait for it, then run this one again")


class NoRoom(Exception):
    """The disk under the store has less free space than a pull or a conversion needs."""


class NotInStore(LookupError):
    """No pulled model has this id."""


class SymlinkInStore(Exception):
    """A path below the store's root is a symlink: the store follows none, and deletes nothing through one."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is a symlink, and the model store follows none: remove that link (what it "
                         "points to is not touched) and run the command again")
        self.path = path


def check_model_id(model_id: str) -> str:
    """`model_id` if the store can hold it and a node may advertise it (wire.protocol's id rule): no
    path separator, and not the bundled model's id."""
    if not model_id or len(model_id) > MAX_MODEL_ID:
        raise InvalidModelId(f"model id {model_id[:40]!r} must be 1 to {MAX_MODEL_ID} characters")
    if "/" in model_id or "\\" in model_id:
        raise InvalidModelId(f"model id {model_id!r} must not contain '/' or '\\'")
    problem = model_id_problem(model_id)
    if problem is not None:
        raise InvalidModelId(f"model id {model_id!r}: {problem}")
    if model_id == BUNDLED_MODEL_ID:
        raise InvalidModelId(f"{BUNDLED_MODEL_ID!r} is the bundled model's id; choose another with --as")
    return model_id


class WeightOrigin(BaseModel):
    """Where stored weights came from on the Hub: the repo, the file in it (empty for an MLX repo,
    taken whole), the revision asked for and the commit it resolved to."""
    model_config = ConfigDict(extra="ignore")

    repo: str
    file: str
    revision: str = "main"
    commit: str | None = None


class Manifest(BaseModel):
    """`models/<id>/manifest.json`: written last, so an entry without one was never completed."""
    model_config = ConfigDict(extra="ignore")

    id: str
    format: WeightFormat = "gguf"
    file: str  # the GGUF file's name, or MLX_DIR_NAME
    size_bytes: int = Field(ge=0)  # of the GGUF file, or of every file of the MLX directory
    weight_hash: str = Field(pattern=WEIGHT_HASH_PATTERN)  # the GGUF's sha256, or the MLX directory's manifest hash
    source: WeightOrigin | None = None  # None: made here (`darkbloom models convert`)
    converted_from: str | None = None  # `ID sha256:…` of the GGUF model a conversion read
    catalog: str | None = None  # the coordinator whose catalog named the weights, when pulled by catalog id
    pulled_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    @model_validator(mode="after")
    def _file_of_format(self) -> "Manifest":
        if (self.format == "gguf") != bool(re.match(GGUF_FILE_NAME, self.file)) or \
                (self.format == "mlx" and self.file != MLX_DIR_NAME):
            raise ValueError(f"a {self.format} model cannot be stored as {self.file!r}")
        return self


@dataclass(frozen=True)
class StoredModel:
    manifest: Manifest
    path: Path  # the GGUF file, or the MLX model directory

    @property
    def format(self) -> WeightFormat:
        return self.manifest.format

    @property
    def id(self) -> str:
        return self.manifest.id


class ModelStore:
    """The pulled models of one `$DARKBLOOM_HOME`. Every path it hands out or deletes is checked to
    lie inside `root`."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.root = home / STORE_DIR

    def get(self, model_id: str) -> StoredModel | None:
        """The pulled model `model_id`, if its manifest and file are complete; raises InvalidModelId."""
        entry = self._entry_dir(model_id)
        if not self._inside(entry):
            return None  # a symlink out of the store
        try:
            manifest = Manifest.model_validate_json((entry / MANIFEST_NAME).read_bytes())
        except (OSError, ValidationError):
            return None
        path = entry / manifest.file
        complete = path.is_file() if manifest.format == "gguf" else path.is_dir()
        if manifest.id != model_id or not self._inside(path) or not complete:
            return None
        return StoredModel(manifest, path)

    def models(self) -> list[StoredModel]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(self.root.iterdir()):
            try:
                stored = self.get(entry.name)
            except InvalidModelId:
                continue
            if stored is not None:
                found.append(stored)
        return found

    def remove(self, model_id: str) -> StoredModel:
        """Delete a pulled model's directory (and any partial download of it); raises NotInStore."""
        stored = self.get(model_id)
        if stored is None:
            raise NotInStore(model_id)
        self._delete(self._entry_dir(model_id))
        self._delete(self.partial_dir(model_id))
        return stored

    def check_room(self, model_id: str, needed: int) -> None:
        """Raise NoRoom when the store's disk has fewer than `needed` bytes free for `model_id`."""
        free = shutil.disk_usage(self.root if self.root.is_dir() else self.home).free
        if needed > free:
            raise NoRoom(f"not enough disk space for {model_id}: it needs {size_text(needed)} more in {self.root}, "
                         f"which has {size_text(free)} free")

    @property
    def lock_path(self) -> Path:
        """Held by the one pull or conversion that may run at a time in this store (`writing`)."""
        return self.root / PARTIAL_DIR / "pull.lock"

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the store's lock while a pull or a conversion writes into it; StoreBusy at once when another
        process holds it."""
        from filelock import FileLock, Timeout

        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.lock_path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise StoreBusy(self.root) from None
        try:
            yield
        finally:
            lock.release()

    def partial_dir(self, model_id: str) -> Path:
        """Where a download of `model_id` in progress is kept."""
        return self.root / PARTIAL_DIR / check_model_id(model_id)

    def refuse_symlinks(self, model_id: str) -> None:
        """Raise SymlinkInStore when a path a pull of `model_id` writes or deletes is a symlink: the
        lock, the partial directory and what it holds, the model's entry, or a directory between one
        of them and `root` (`root` itself may be one: a store on another disk). Each is looked at
        with lstat, never followed."""
        partial_dir = self.partial_dir(model_id)
        self._refuse_symlinks([self.lock_path, partial_dir, self._entry_dir(model_id)])
        if partial_dir.is_dir():
            self._refuse_symlinks(sorted(partial_dir.iterdir()))

    def _refuse_symlinks(self, paths: list[Path]) -> None:
        for path in paths:
            current = self.root
            for name in path.relative_to(self.root).parts:
                current = current / name
                try:
                    if stat.S_ISLNK(current.lstat().st_mode):
                        raise SymlinkInStore(current)
                except FileNotFoundError:
                    break

    def install(self, download: Path, manifest: Manifest) -> StoredModel:
        """Move a complete, verified `download` (the GGUF file or the MLX directory) into the store under
        `manifest.id`, replacing what was there in one rename; the manifest is written before that rename."""
        entry = self._entry_dir(manifest.id)
        partial = self.partial_dir(manifest.id).parent
        partial.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=partial))  # no model id starts with a dot
        os.replace(download, staging / manifest.file)
        (staging / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2) + "\n")
        retired = staging.with_name(staging.name + ".old")
        if entry.is_symlink() or entry.exists():
            os.replace(entry, retired)
        os.replace(staging, entry)
        self._delete(retired)
        stored = self.get(manifest.id)
        assert stored is not None, f"{entry} was just installed"
        return stored

    def _entry_dir(self, model_id: str) -> Path:
        """`root/<id>`: a valid id has no separator and no leading dot, so the name stays in `root`."""
        return self.root / check_model_id(model_id)

    def _inside(self, path: Path) -> bool:
        """Whether `path`, with every symlink followed, still lies below `root`."""
        root = self.root.resolve()
        resolved = path.resolve()
        return resolved != root and resolved.is_relative_to(root)

    def _delete(self, path: Path) -> None:
        """Remove a directory of the store; a symlink is unlinked, never followed."""
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir() and self._inside(path):
            shutil.rmtree(path)


def size_text(n: int | None) -> str:
    """A size on disk as a person reads it: `1.23 GB`, `94.1 MB`, `4.1 kB`."""
    if n is None:
        return "size unknown"
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
