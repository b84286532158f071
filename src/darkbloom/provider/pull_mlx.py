"""A pull of an MLX model repo: its top-level safetensors, JSON and tokenizer files downloaded at one
commit into a partial directory (each file resumable), every LFS file checked against the Hub's
sha256, the directory's manifest hash against the catalog's pin, then installed in one rename."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from huggingface_hub import ModelInfo
from huggingface_hub.utils import filter_repo_objects

from darkbloom.provider import mlx_model
from darkbloom.provider.hub_transfer import PullError, PullTarget, already, download, drop_other_partials, \
    endpoint_text, file_metadata, file_size, interrupted, repo_info, same_source, say
from darkbloom.provider.model_store import MLX_DIR_NAME, Manifest, ModelStore, StoredModel, SymlinkInStore, \
    WeightOrigin, size_text
from darkbloom.provider.models import HASH_CACHE_NAME, record_weight_hash

# What an MLX model is made of: weights, configs (model, generation, tokenizer, the weights' index),
# tokenizer vocabularies (BPE merges and vocab, SentencePiece, tiktoken) and chat templates.
MLX_PATTERNS = ["*.safetensors", "*.json", "*.txt", "tokenizer.model", "*.tiktoken", "*.jinja"]
_PARTIAL_SUFFIX = ".incomplete"


@dataclass(frozen=True)
class HubFile:
    """One file of the model as the Hub's listing announces it."""
    name: str
    size: int
    sha256: str | None  # an LFS file's; None for a file kept in git


def mlx_files(names: list[str]) -> list[str] | None:
    """The files of an MLX model in a repo's listing — those at its top level matching MLX_PATTERNS,
    hidden ones aside — or None when they hold no `config.json` or no safetensors weights."""
    top = [name for name in names if "/" not in name and not name.startswith(".")]
    chosen = sorted(filter_repo_objects(top, allow_patterns=MLX_PATTERNS))
    if mlx_model.CONFIG_NAME not in chosen or not any(name.endswith(mlx_model.WEIGHTS_SUFFIX) for name in chosen):
        return None
    return chosen


def pull_mlx(target: PullTarget, store: ModelStore, partial_dir: Path, endpoint: str | None,
             progress: TextIO) -> StoredModel:
    """Download the MLX model of `target.repo` (resuming a partial download of it at the same commit),
    verify it and install it. The caller holds the store's pull lock."""
    existing = store.get(target.model_id)
    if existing is not None and target.weight_hash and existing.manifest.weight_hash == target.weight_hash:
        return already(existing, progress)
    if target.size_bytes is not None:
        store.check_room(target.model_id, target.size_bytes - _partial_bytes(partial_dir))
    info = repo_info(target.repo, target.revision, endpoint, files_metadata=True)
    if not info.sha:
        raise PullError(f"{endpoint_text(endpoint)} names no commit for {target.describe()}; check HF_ENDPOINT")
    commit = info.sha
    if existing is not None and same_source(existing, target) and existing.manifest.source is not None \
            and existing.manifest.source.commit == commit:
        return already(existing, progress)
    files = _announced(target, info, endpoint)
    total = sum(file.size for file in files)
    if target.size_bytes is not None and total != target.size_bytes:
        raise PullError(f"{target.describe()} on the Hub is {total} bytes, not the catalog's size_bytes "
                        f"{target.size_bytes}; nothing was downloaded (tell the coordinator's operator)")
    folder = partial_dir / _download_key(target, commit)
    drop_other_partials(partial_dir, keep=folder)
    folder.mkdir(exist_ok=True)
    _keep_only(folder, {name for file in files for name in (file.name, file.name + _PARTIAL_SUFFIX)})
    held = _held_bytes(folder, files)
    store.check_room(target.model_id, total - held)
    where = f"resuming at {size_text(held)} of {size_text(total)}" if held else size_text(total)
    say(progress, f"pulling {target.model_id}: {target.describe()} ({len(files)} files, {where})")
    try:
        for file in files:
            _fetch(target, file, folder, commit, endpoint)
    except KeyboardInterrupt:
        raise interrupted(target, f"{size_text(_held_bytes(folder, files))} of {size_text(total)}") from None
    return _verify_and_install(target, files, folder, commit, total, store, progress)


def _announced(target: PullTarget, info: ModelInfo, endpoint: str | None) -> list[HubFile]:
    """The model's files with the size (and, for LFS files, sha256) the listing gives each."""
    siblings = {sibling.rfilename: sibling for sibling in info.siblings or []}
    names = mlx_files(list(siblings))
    if names is None:
        remedy = " (tell the coordinator's operator)" if target.catalog else ""
        raise PullError(f"{target.describe()} holds no MLX model: no {mlx_model.CONFIG_NAME} and "
                        f"{mlx_model.WEIGHTS_SUFFIX} weights at its top level{remedy}")
    files = []
    for name in names:
        if "\\" in name or not name.isprintable():
            raise PullError(f"the Hub file {name!r} of {target.repo} cannot be stored: its name must not contain "
                            "'\\' or control characters")
        sibling = siblings[name]
        if sibling.size is None:
            raise PullError(f"{endpoint_text(endpoint)} announces no size for {target.describe(name)}, so its "
                            "download could not be bounded; check HF_ENDPOINT")
        sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        files.append(HubFile(name, sibling.size, sha256))
    return files


def _fetch(target: PullTarget, file: HubFile, folder: Path, commit: str, endpoint: str | None) -> None:
    """One file into `folder` under its own name, unless a previous run finished it; while it
    downloads it is `NAME.incomplete`."""
    done = folder / file.name
    if _regular_size(done) == file.size:
        return
    done.unlink(missing_ok=True)
    metadata = file_metadata(target, file.name, commit, endpoint)
    if metadata.size is not None and metadata.size != file.size:
        raise PullError(f"the Hub announces {target.describe(file.name)} as {file.size} bytes in its listing and "
                        f"{metadata.size} when asked for it; nothing more was downloaded, check HF_ENDPOINT")
    partial = folder / (file.name + _PARTIAL_SUFFIX)
    resume = _regular_size(partial) or 0
    if resume > file.size:
        partial.unlink()
        resume = 0
    download(target, file.name, metadata, partial, resume, file.size, endpoint)
    os.replace(partial, done)


def _verify_and_install(target: PullTarget, files: list[HubFile], folder: Path, commit: str, total: int,
                        store: ModelStore, progress: TextIO) -> StoredModel:
    if mlx_model.model_files(folder) != [file.name for file in files]:
        shutil.rmtree(folder)
        raise PullError(f"the download of {target.describe()} does not hold the files the Hub listed; it was "
                        "deleted, run the command again")
    try:
        mlx_model.read_config(folder)
    except mlx_model.NotAnMlxModel as exc:
        shutil.rmtree(folder)
        raise PullError(f"{target.describe()} is not an MLX model ({exc}); its download was deleted") from None
    say(progress, "checking sha256…")
    manifest_text = mlx_model.manifest_text(folder)
    digests = dict(line.rsplit(" ", 1) for line in manifest_text.splitlines())
    wrong = [file for file in files if file.sha256 is not None and digests[file.name] != file.sha256]
    if wrong:
        for file in wrong:
            (folder / file.name).unlink()
        others = f" (and {len(wrong) - 1} more file(s))" if len(wrong) > 1 else ""
        raise PullError(f"the downloaded {wrong[0].name}'s sha256 sha256:{digests[wrong[0].name]} differs from the "
                        f"Hub's sha256 sha256:{wrong[0].sha256}{others}; it was deleted")
    digest = "sha256:" + hashlib.sha256(manifest_text.encode()).hexdigest()
    if target.weight_hash and digest != target.weight_hash:
        shutil.rmtree(folder)
        raise PullError(f"the downloaded model's manifest hash {digest} differs from the catalog's weight_hash "
                        f"{target.weight_hash}; the download was deleted")
    manifest = Manifest(id=target.model_id, format="mlx", file=MLX_DIR_NAME, size_bytes=total, weight_hash=digest,
                        catalog=target.catalog,
                        source=WeightOrigin(repo=target.repo, file="", revision=target.revision, commit=commit))
    stored = store.install(folder, manifest)
    shutil.rmtree(folder.parent, ignore_errors=True)
    record_weight_hash(stored.path.resolve(), digest, store.home / HASH_CACHE_NAME)
    return stored


def _keep_only(folder: Path, names: set[str]) -> None:
    """Refuse a symlink in the partial directory; delete what is not one of the model's files."""
    for entry in folder.iterdir():
        if entry.is_symlink():
            raise SymlinkInStore(entry)
        if entry.name in names:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _download_key(target: PullTarget, commit: str) -> str:
    """Names the partial directory: files of another repo or commit are never resumed."""
    return hashlib.sha256(f"{target.repo}\n{commit}".encode()).hexdigest()[:32]


def _regular_size(path: Path) -> int | None:
    """The size of a regular file at `path`, None when there is none; a symlink there is refused."""
    try:
        found = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        raise SymlinkInStore(path)
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def _held_bytes(folder: Path, files: list[HubFile]) -> int:
    """What the partial directory already holds of the model, finished files and partial ones."""
    held = 0
    for file in files:
        if _regular_size(folder / file.name) == file.size:
            held += file.size
        else:
            held += min(_regular_size(folder / (file.name + _PARTIAL_SUFFIX)) or 0, file.size)
    return held


def _partial_bytes(partial_dir: Path) -> int:
    """What any partial download of this id holds (before the Hub says which one is resumed)."""
    if not partial_dir.is_dir():
        return 0
    return max((sum(file_size(path) for path in entry.iterdir()) for entry in partial_dir.iterdir()
                if entry.is_dir() and not entry.is_symlink()), default=0)
