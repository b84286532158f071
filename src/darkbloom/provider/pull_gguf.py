"""A pull of one GGUF file of a Hub repo: its partial file resumed, checked against what the Hub and
the catalog announce, verified (GGUF magic, sha256) and installed in one rename."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import TextIO

from huggingface_hub.file_download import HfFileMetadata

from darkbloom.provider.hub_transfer import SHA256_HEX, PullError, PullTarget, already, download, \
    drop_other_partials, endpoint_text, file_metadata, file_size, same_source, say
from darkbloom.provider.model_store import GGUF_FILE_NAME, Manifest, ModelStore, StoredModel, WeightOrigin, size_text
from darkbloom.provider.models import HASH_CACHE_NAME, record_weight_hash

GGUF_MAGIC = b"GGUF"


def gguf_files(names: list[str]) -> list[str]:
    """The GGUF files of a repo's listing, sorted."""
    return sorted(name for name in names if name.lower().endswith(".gguf"))


def only_gguf(repo: str, ggufs: list[str]) -> str:
    """The one GGUF file of a repo; with several, exit 2 listing them."""
    if len(ggufs) > 1:
        listing = "".join(f"\n  {name}" for name in ggufs)
        raise PullError(f"{repo} has {len(ggufs)} GGUF files; choose one with --file (or {repo}:FILE):{listing}",
                        exit_code=2)
    return ggufs[0]


def check_gguf_name(file: str, remedy: str) -> None:
    """The file is stored under the last part of its name: one the store can hold, from a name with
    no backslash (another system's folder separator) or control character."""
    if "\\" in file or not file.isprintable() or not re.match(GGUF_FILE_NAME, PurePosixPath(file).name):
        raise PullError(f"the Hub file {file!r} cannot be stored: its name must not contain '\\' or control "
                        f"characters, and must name something before '.gguf'; {remedy}")


def pull_gguf(target: PullTarget, store: ModelStore, partial_dir: Path, endpoint: str | None,
              progress: TextIO) -> StoredModel:
    """Download `target` (resuming a partial download of it), check it is GGUF with the expected
    sha256, and install it. The caller holds the store's pull lock."""
    existing = store.get(target.model_id)
    if existing is not None and target.weight_hash and existing.manifest.weight_hash == target.weight_hash:
        return already(existing, progress)
    if target.size_bytes is not None:
        store.check_room(target.model_id, target.size_bytes - _largest_partial(partial_dir))
    metadata = file_metadata(target, target.file, target.revision, endpoint)
    hub_sha256 = "sha256:" + metadata.etag if metadata.etag and SHA256_HEX.match(metadata.etag) else None
    if target.weight_hash and hub_sha256 and hub_sha256 != target.weight_hash:
        raise PullError(f"{target.describe()} on the Hub has sha256 {hub_sha256}, not the catalog's weight_hash "
                        f"{target.weight_hash}; nothing was downloaded (tell the coordinator's operator)")
    if target.size_bytes is not None and metadata.size is not None and metadata.size != target.size_bytes:
        raise PullError(f"{target.describe()} on the Hub is {metadata.size} bytes, not the catalog's size_bytes "
                        f"{target.size_bytes}; nothing was downloaded (tell the coordinator's operator)")
    expected_hash = target.weight_hash or hub_sha256
    if existing is not None and (existing.manifest.weight_hash == expected_hash or (
            same_source(existing, target) and existing.manifest.source is not None
            and existing.manifest.source.commit == metadata.commit_hash)):
        return already(existing, progress)
    size = target.size_bytes if target.size_bytes is not None else metadata.size
    if size is None:
        raise PullError(f"{endpoint_text(endpoint)} announces no size for {target.describe()}, so its download "
                        "could not be bounded; check HF_ENDPOINT")
    partial = partial_dir / (_download_key(target, metadata) + ".incomplete")
    drop_other_partials(partial_dir, keep=partial)
    resume = partial.stat().st_size if partial.is_file() else 0
    if resume > size:
        partial.unlink()
        resume = 0
    store.check_room(target.model_id, size - resume)
    where = f"resuming at {size_text(resume)} of {size_text(size)}" if resume else size_text(size)
    say(progress, f"pulling {target.model_id}: {target.describe()} ({where})")
    download(target, target.file, metadata, partial, resume, size, endpoint)
    return _verify_and_install(target, metadata, partial, expected_hash, store, progress)


def _verify_and_install(target: PullTarget, metadata: HfFileMetadata, partial: Path, expected_hash: str | None,
                        store: ModelStore, progress: TextIO) -> StoredModel:
    with partial.open("rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        partial.unlink()
        raise PullError(f"{target.describe()} is not a GGUF file (it does not start with 'GGUF'); it was deleted")
    say(progress, "checking sha256…")
    with partial.open("rb") as fh:
        digest = "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
    if expected_hash and digest != expected_hash:
        partial.unlink()
        pinned = "the catalog's weight_hash" if target.weight_hash else "the Hub's sha256"
        raise PullError(f"the downloaded file's sha256 {digest} differs from {pinned} {expected_hash}; "
                        "the file was deleted")
    manifest = Manifest(id=target.model_id, file=PurePosixPath(target.file).name, size_bytes=partial.stat().st_size,
                        weight_hash=digest, catalog=target.catalog,
                        source=WeightOrigin(repo=target.repo, file=target.file, revision=target.revision,
                                            commit=metadata.commit_hash))
    stored = store.install(partial, manifest)
    shutil.rmtree(partial.parent, ignore_errors=True)
    record_weight_hash(stored.path.resolve(), digest, store.home / HASH_CACHE_NAME)
    return stored


def _download_key(target: PullTarget, metadata: HfFileMetadata) -> str:
    """Names the partial file: a partial of other bytes (another file, or the same one changed) is
    never resumed."""
    return hashlib.sha256(f"{target.repo}\n{target.file}\n{metadata.etag}".encode()).hexdigest()[:32]


def _largest_partial(partial_dir: Path) -> int:
    return max((file_size(path) for path in partial_dir.glob("*.incomplete")), default=0)
