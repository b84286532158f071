"""`darkbloom models pull`: a model of the coordinator's catalog, or a GGUF file of a Hugging Face Hub
repo, downloaded into the model store — resumable, checked, never half-installed (docs/models.md
"Pulling a model")."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TextIO
from urllib.parse import urlsplit

import httpx
import httpx2
from filelock import FileLock, Timeout
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                    RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.file_download import HfFileMetadata, http_get
from huggingface_hub.utils import build_hf_headers, validate_repo_id
from pydantic import ValidationError

from darkbloom.provider.model_store import GGUF_FILE_NAME, InvalidModelId, Manifest, ModelStore, StoredModel, \
    SymlinkInStore, WeightOrigin, check_model_id
from darkbloom.provider.models import HASH_CACHE_NAME, record_weight_hash
from darkbloom.wire.catalog import BUNDLED_MODEL_ID, Catalog, CatalogModel

GGUF_MAGIC = b"GGUF"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_CATALOG_TIMEOUT = 10.0


class PullError(Exception):
    """A pull that cannot go on; the message is one line naming the cause."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class OverlongDownload(Exception):
    """The Hub sent more bytes of a file than the size it (or the catalog) announced."""


@dataclass(frozen=True)
class PullTarget:
    """One GGUF file on the Hub and the store id it goes under; from a catalog entry, its pins."""
    model_id: str
    repo: str
    file: str
    revision: str = "main"
    weight_hash: str | None = None
    size_bytes: int | None = None
    catalog: str | None = None  # the coordinator whose catalog named it

    def describe(self) -> str:
        return f"{self.repo}/{self.file} at {self.revision}"


def pull_model(name: str, store: ModelStore, *, coordinator_url: str | None = None, file: str | None = None,
               revision: str | None = None, as_id: str | None = None, endpoint: str | None = None,
               progress: TextIO = sys.stderr) -> StoredModel:
    """`darkbloom models pull NAME`: a NAME with a '/' is a Hub repo (`owner/name[:file.gguf]`),
    any other a catalog id of the coordinator. `endpoint` None: HF_ENDPOINT or the Hub."""
    if _is_hub_name(name):
        target = hub_target(name, file=file, revision=revision, as_id=as_id, endpoint=endpoint)
    else:
        given = [flag for flag, value in (("--file", file), ("--revision", revision), ("--as", as_id)) if value]
        if given:
            raise PullError(f"{name!r} is a catalog id, pulled from the source its catalog entry names and stored "
                            f"under that id: {', '.join(given)} only go with a Hub repo (owner/name)")
        if name == BUNDLED_MODEL_ID:
            raise PullError(f"{name!r} is the bundled model: `darkbloom serve` serves it as it is, with no pull")
        if not coordinator_url:
            raise PullError(f"no coordinator to look {name!r} up in: pass --coordinator URL or set "
                            "DARKBLOOM_COORDINATOR (or run `darkbloom login`); a Hub repo is named owner/name")
        target = catalog_target(name, fetch_catalog(coordinator_url), coordinator_url)
    return pull(target, store, endpoint=endpoint, progress=progress)


def pull_missing(model_ids: list[str], coordinator_url: str, store: ModelStore, *, endpoint: str | None = None,
                 progress: TextIO = sys.stderr) -> None:
    """`serve --pull`: each model id the store lacks, from the catalog of the node's coordinator."""
    catalog = fetch_catalog(coordinator_url)
    for model_id in model_ids:
        target = catalog_target(model_id, catalog, coordinator_url)
        if target.model_id != model_id:
            raise PullError(f"{model_id!r} is an alias of the catalog's {target.model_id!r}; "
                            f"serve it as --model {target.model_id}")
        pull(target, store, endpoint=endpoint, progress=progress)


def fetch_catalog(coordinator_url: str, timeout: float = _CATALOG_TIMEOUT) -> Catalog:
    """The coordinator's catalog (GET /v1/models/catalog, no auth). Fields this node does not know
    are ignored, so a newer coordinator's catalog still reads."""
    parts = urlsplit(coordinator_url.rstrip("/"))
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    base = f"{scheme}://{parts.netloc}{parts.path}"
    url = (base if base.endswith("/v1") else base + "/v1") + "/models/catalog"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PullError(f"cannot reach the coordinator at {coordinator_url}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise PullError(f"the coordinator at {coordinator_url} answered {response.status_code} "
                        "to GET /v1/models/catalog")
    try:
        entries = response.json()["data"]
        return Catalog(models=[CatalogModel.model_validate(
            {key: value for key, value in entry.items() if key in CatalogModel.model_fields}) for entry in entries])
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError):
        raise PullError(f"{url} did not answer with a model catalog") from None


def catalog_target(name: str, catalog: Catalog, coordinator_url: str) -> PullTarget:
    entry = catalog.resolve(name)
    if entry is None:
        known = ", ".join(model.id for model in catalog.models[:12]) or "none"
        raise PullError(f"the catalog of {coordinator_url} has no model {name!r} (it lists: {known})")
    if entry.source is None:
        raise PullError(f"catalog model {entry.id!r} names no source for its weights; pull a Hub repo "
                        f"instead: darkbloom models pull owner/name --as {entry.id}")
    try:
        model_id = check_model_id(entry.id)
    except InvalidModelId as exc:
        raise PullError(f"catalog model {entry.id!r} cannot be stored under its id: {exc}") from None
    _check_file_name(entry.source.file, "tell the coordinator's operator")
    return PullTarget(model_id, entry.source.repo, entry.source.file, entry.source.revision,
                      weight_hash=entry.weight_hash, size_bytes=entry.size_bytes, catalog=coordinator_url)


def hub_target(name: str, *, file: str | None = None, revision: str | None = None, as_id: str | None = None,
               endpoint: str | None = None) -> PullTarget:
    """`owner/name`, `owner/name:file.gguf` or `owner/name --file F`: a repo with one GGUF file needs
    no file named; one with several exits 2 listing them."""
    repo, _, inline_file = name.partition(":")
    if inline_file and file and inline_file != file:
        raise PullError(f"{name!r} names the file {inline_file!r} and --file another, {file!r}; give one")
    try:
        if repo.count("/") != 1:
            raise HFValidationError("not owner/name")
        validate_repo_id(repo)
    except HFValidationError:
        raise PullError(f"{repo!r} is not a Hub repo id; write owner/name (or owner/name:file.gguf)") from None
    if as_id is not None:
        _store_id(as_id)
    revision = revision or "main"
    file = file or inline_file or _only_gguf(repo, revision, endpoint)
    if not file.lower().endswith(".gguf"):
        raise PullError(f"{file!r} is not a .gguf file; a node serves GGUF weights only")
    _check_file_name(file, "choose another file with --file")
    return PullTarget(_store_id(as_id if as_id is not None else PurePosixPath(file).stem.lower()), repo, file,
                      revision)


def _check_file_name(file: str, remedy: str) -> None:
    """The file is stored under the last part of its name: one the store can hold, from a name with
    no backslash (another system's folder separator) or control character."""
    if "\\" in file or not file.isprintable() or not re.match(GGUF_FILE_NAME, PurePosixPath(file).name):
        raise PullError(f"the Hub file {file!r} cannot be stored: its name must not contain '\\' or control "
                        f"characters, and must name something before '.gguf'; {remedy}")


def _store_id(model_id: str) -> str:
    try:
        return check_model_id(model_id)
    except InvalidModelId as exc:
        raise PullError(str(exc)) from None


def pull(target: PullTarget, store: ModelStore, *, endpoint: str | None = None,
         progress: TextIO = sys.stderr) -> StoredModel:
    """Download `target` (resuming a partial download of it), check it is GGUF with the expected
    sha256, and install it in the store in one rename. No symlink under the store is followed.
    Raises PullError."""
    try:
        store.refuse_symlinks(target.model_id)
        store.lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(store.lock_path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise PullError(f"another pull is running in {store.root}; wait for it, then run this one "
                            "again") from None
        try:
            return _pull_locked(target, store, store.partial_dir(target.model_id), endpoint, progress)
        finally:
            lock.release()
    except SymlinkInStore as exc:
        raise PullError(str(exc)) from None


def _pull_locked(target: PullTarget, store: ModelStore, partial_dir: Path, endpoint: str | None,
                 progress: TextIO) -> StoredModel:
    existing = store.get(target.model_id)
    if existing is not None and target.weight_hash and existing.manifest.weight_hash == target.weight_hash:
        return _already(existing, progress)
    if target.size_bytes is not None:
        _check_room(store, target.model_id, target.size_bytes - _largest_partial(partial_dir))
    metadata = _file_metadata(target, endpoint)
    hub_sha256 = "sha256:" + metadata.etag if metadata.etag and _SHA256_HEX.match(metadata.etag) else None
    if target.weight_hash and hub_sha256 and hub_sha256 != target.weight_hash:
        raise PullError(f"{target.describe()} on the Hub has sha256 {hub_sha256}, not the catalog's weight_hash "
                        f"{target.weight_hash}; nothing was downloaded (tell the coordinator's operator)")
    if target.size_bytes is not None and metadata.size is not None and metadata.size != target.size_bytes:
        raise PullError(f"{target.describe()} on the Hub is {metadata.size} bytes, not the catalog's size_bytes "
                        f"{target.size_bytes}; nothing was downloaded (tell the coordinator's operator)")
    expected_hash = target.weight_hash or hub_sha256
    if existing is not None and (existing.manifest.weight_hash == expected_hash or (
            _same_source(existing, target) and existing.manifest.source is not None
            and existing.manifest.source.commit == metadata.commit_hash)):
        return _already(existing, progress)
    size = target.size_bytes if target.size_bytes is not None else metadata.size
    if size is None:
        raise PullError(f"{_endpoint(endpoint)} announces no size for {target.describe()}, so its download "
                        "could not be bounded; check HF_ENDPOINT")
    partial = partial_dir / (_download_key(target, metadata) + ".incomplete")
    _drop_other_partials(partial_dir, keep=partial)
    resume = partial.stat().st_size if partial.is_file() else 0
    if resume > size:
        partial.unlink()
        resume = 0
    _check_room(store, target.model_id, size - resume)
    where = f"resuming at {_size(resume)} of {_size(size)}" if resume else _size(size)
    _say(progress, f"pulling {target.model_id}: {target.describe()} ({where})")
    _download(target, metadata, partial, resume, size, endpoint)
    return _verify_and_install(target, metadata, partial, expected_hash, store, progress)


def _already(stored: StoredModel, progress: TextIO) -> StoredModel:
    _say(progress, f"{stored.id} is already in the model store")
    return stored


def _same_source(stored: StoredModel, target: PullTarget) -> bool:
    source = stored.manifest.source
    return source is not None and (source.repo, source.file, source.revision) == (target.repo, target.file,
                                                                                  target.revision)


def _file_metadata(target: PullTarget, endpoint: str | None) -> HfFileMetadata:
    """The Hub's HEAD of the file: commit, ETag (the sha256 for an LFS file), size, download location."""
    url = hf_hub_url(target.repo, target.file, revision=target.revision, endpoint=endpoint)
    try:
        metadata = get_hf_file_metadata(url, endpoint=endpoint)
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise _hub_failure(exc, target.repo, target.revision, endpoint, file=target.file) from None
    if metadata.commit_hash is None or metadata.etag is None:
        raise PullError(f"{_endpoint(endpoint)} does not answer like a Hugging Face Hub (no X-Repo-Commit or "
                        "ETag header); check HF_ENDPOINT")
    return metadata


def _only_gguf(repo: str, revision: str, endpoint: str | None) -> str:
    try:
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise _hub_failure(exc, repo, revision, endpoint) from None
    ggufs = sorted(s.rfilename for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf"))
    if not ggufs:
        raise PullError(f"{repo} at {revision} has no .gguf file; a node serves GGUF weights only")
    if len(ggufs) > 1:
        listing = "".join(f"\n  {name}" for name in ggufs)
        raise PullError(f"{repo} has {len(ggufs)} GGUF files; choose one with --file (or {repo}:FILE):{listing}",
                        exit_code=2)
    return ggufs[0]


def _download(target: PullTarget, metadata: HfFileMetadata, partial: Path, resume: int, size: int,
              endpoint: str | None) -> None:
    """The Hub client's own ranged GET (progress bar, retries that resume) into our partial file,
    which, unlike the Hub's temporary file, outlives an interrupted run. The file is opened without
    following a symlink, and never grows past `size`. A server that stops sending is asked again
    after HF_HUB_DOWNLOAD_TIMEOUT seconds of silence, five times in a row at most, then given up."""
    headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
    hub_url = hf_hub_url(target.repo, target.file, revision=target.revision, endpoint=endpoint)
    if urlsplit(metadata.location)[:2] != urlsplit(hub_url)[:2]:
        headers.pop("authorization", None)  # a signed CDN address: the Hub token stays with the Hub
    try:
        with _open_partial(partial, resume) as fh:
            fh.seek(resume)
            http_get(metadata.location, _Capped(fh, size), resume_size=resume, headers=headers,
                     expected_size=size, displayed_filename=PurePosixPath(target.file).name)
    except OverlongDownload:
        partial.unlink(missing_ok=True)
        raise PullError(f"the Hub sent more than the {size} bytes announced for {target.describe()}: the download "
                        "was stopped there and its partial file deleted; check HF_ENDPOINT, whose server sends "
                        "other bytes than it announces") from None
    except SymlinkInStore as exc:
        raise PullError(str(exc)) from None
    except KeyboardInterrupt:
        raise PullError(f"pull of {target.model_id} interrupted at {_size(_file_size(partial))}; run the same "
                        "command again to resume", exit_code=130) from None
    except httpx2.ReadTimeout:
        raise PullError(f"the download of {target.describe()} stalled: nothing arrived for "
                        f"{constants.HF_HUB_DOWNLOAD_TIMEOUT} s, again after each of the Hub client's retries "
                        f"(HF_HUB_DOWNLOAD_TIMEOUT); {_size(_file_size(partial))} kept, run the same command again "
                        "to resume") from None
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise _hub_failure(exc, target.repo, target.revision, endpoint, file=target.file, resumable=True) from None
    except OSError as exc:
        if exc.errno is None:  # http_get's size check: the bytes received do not make the file announced
            partial.unlink(missing_ok=True)
            raise PullError(f"download of {target.describe()} did not match its announced size; the partial "
                            "file was deleted, run the command again") from None
        raise PullError(f"cannot write {partial}: {exc.strerror}; run the same command again to resume") from None


def _open_partial(partial: Path, resume: int) -> BinaryIO:
    """The partial file for writing, never through a symlink (O_NOFOLLOW); raises SymlinkInStore."""
    flags = (os.O_RDWR if resume else os.O_WRONLY | os.O_CREAT | os.O_TRUNC) | os.O_NOFOLLOW
    try:
        fd = os.open(partial, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkInStore(partial) from None
        raise
    return os.fdopen(fd, "r+b" if resume else "wb")


class _Capped:
    """A file that refuses, with OverlongDownload, any write that would take it past `limit` bytes."""

    def __init__(self, fh: BinaryIO, limit: int) -> None:
        self._fh = fh
        self._limit = limit

    def write(self, data: bytes) -> int:
        if self._fh.tell() + len(data) > self._limit:
            raise OverlongDownload()
        return self._fh.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _verify_and_install(target: PullTarget, metadata: HfFileMetadata, partial: Path, expected_hash: str | None,
                        store: ModelStore, progress: TextIO) -> StoredModel:
    with partial.open("rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        partial.unlink()
        raise PullError(f"{target.describe()} is not a GGUF file (it does not start with 'GGUF'); it was deleted")
    _say(progress, "checking sha256…")
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


def _hub_failure(exc: Exception, repo: str, revision: str, endpoint: str | None, *, file: str | None = None,
                 resumable: bool = False) -> PullError:
    """One line for what the Hub client raised."""
    hub = _endpoint(endpoint)
    again = "; run the same command again to resume" if resumable else ""
    if isinstance(exc, GatedRepoError):
        return PullError(f"{repo} is gated on {hub}: accept its terms there and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return PullError(f"repository {repo} not found on {hub} (a private repo needs HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return PullError(f"revision {revision!r} not found in {repo} on {hub}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return PullError(f"file {file!r} not found in {repo} at {revision} on {hub}")
    if isinstance(exc, OfflineModeIsEnabled):
        return PullError("HF_HUB_OFFLINE is set: the Hub cannot be reached; unset it to pull")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return PullError(f"the Hub at {hub} answered {status} for {repo}{'/' + file if file else ''}{again}")
    return PullError(f"cannot reach the Hub at {hub}: {exc or type(exc).__name__}{again}")


def _check_room(store: ModelStore, model_id: str, needed: int) -> None:
    free = shutil.disk_usage(store.root).free
    if needed > free:
        raise PullError(f"not enough disk space for {model_id}: it needs {_size(needed)} more in {store.root}, "
                        f"which has {_size(free)} free")


def _download_key(target: PullTarget, metadata: HfFileMetadata) -> str:
    """Names the partial file: a partial of other bytes (another file, or the same one changed) is
    never resumed."""
    return hashlib.sha256(f"{target.repo}\n{target.file}\n{metadata.etag}".encode()).hexdigest()[:32]


def _largest_partial(partial_dir: Path) -> int:
    return max((_file_size(path) for path in partial_dir.glob("*.incomplete")), default=0)


def _drop_other_partials(partial_dir: Path, keep: Path) -> None:
    partial_dir.mkdir(parents=True, exist_ok=True)
    for stale in partial_dir.glob("*.incomplete"):
        if stale != keep:
            stale.unlink(missing_ok=True)


def _is_hub_name(name: str) -> bool:
    return "/" in name.partition(":")[0]


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _say(progress: TextIO, line: str) -> None:
    progress.write(line + "\n")
    progress.flush()
