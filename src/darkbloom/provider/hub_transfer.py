"""What a pull of either format — a GGUF file, an MLX model directory — asks of the Hugging Face Hub:
what to pull (PullTarget), the repo's listing, one file's metadata, one file's ranged download into
a partial file that outlives the run, and every failure as one PullError line (docs/models.md
"Pulling a model")."""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TextIO
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, ModelInfo, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RemoteEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.file_download import HfFileMetadata, http_get
from huggingface_hub.utils import build_hf_headers

from darkbloom.provider.model_store import ModelStore, StoredModel, SymlinkInStore, WeightFormat, size_text

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class PullError(Exception):
    """A pull that cannot go on; the message is one line naming the cause."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class OverlongDownload(Exception):
    """The Hub sent more bytes of a file than the size it (or the catalog) announced."""


@dataclass(frozen=True)
class PullTarget:
    """What to pull from the Hub — one GGUF file, or an MLX repo taken whole (`file` empty) — and
    the store id it goes under; from a catalog entry, its pins."""
    model_id: str
    repo: str
    file: str
    revision: str = "main"
    format: WeightFormat = "gguf"
    weight_hash: str | None = None
    size_bytes: int | None = None
    catalog: str | None = None  # the coordinator whose catalog named it

    def describe(self, file: str | None = None) -> str:
        """`repo/file at revision` (the target's file, or one of an MLX repo's), or `repo at revision`."""
        file = self.file if file is None else file
        return f"{self.repo}/{file} at {self.revision}" if file else f"{self.repo} at {self.revision}"


def repo_info(repo: str, revision: str, endpoint: str | None, *, files_metadata: bool = False) -> ModelInfo:
    """The Hub's listing of the repo at `revision`: its commit (`sha`) and files (`siblings`; with
    `files_metadata`, each one's size and, for an LFS file, its sha256)."""
    try:
        return HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=files_metadata,
                                                   timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise hub_failure(exc, repo, revision, endpoint) from None


def file_metadata(target: PullTarget, file: str, revision: str, endpoint: str | None) -> HfFileMetadata:
    """The Hub's HEAD of one file: commit, ETag (the sha256 for an LFS file), size, download location."""
    url = hf_hub_url(target.repo, file, revision=revision, endpoint=endpoint)
    try:
        metadata = get_hf_file_metadata(url, endpoint=endpoint)
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise hub_failure(exc, target.repo, target.revision, endpoint, file=file) from None
    if metadata.commit_hash is None or metadata.etag is None:
        raise PullError(f"{endpoint_text(endpoint)} does not answer like a Hugging Face Hub (no X-Repo-Commit or "
                        "ETag header); check HF_ENDPOINT")
    return metadata


def download(target: PullTarget, file: str, metadata: HfFileMetadata, partial: Path, resume: int, size: int,
             endpoint: str | None) -> None:
    """The Hub client's own ranged GET (progress bar, retries that resume) of the Hub's `file` into
    our partial file, which, unlike the Hub client's temporary file, outlives an interrupted run. The
    file is opened without following a symlink, and never grows past `size`. A server that stops
    sending is asked again after HF_HUB_DOWNLOAD_TIMEOUT seconds of silence, five times in a row at
    most, then given up."""
    headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
    hub_url = hf_hub_url(target.repo, file, revision=target.revision, endpoint=endpoint)
    if urlsplit(metadata.location)[:2] != urlsplit(hub_url)[:2]:
        headers.pop("authorization", None)  # a signed CDN address: the Hub token stays with the Hub
    name = PurePosixPath(file).name
    try:
        with _open_partial(partial, resume) as fh:
            fh.seek(resume)
            http_get(metadata.location, _Capped(fh, size), resume_size=resume, headers=headers,
                     expected_size=size, displayed_filename=name)
    except OverlongDownload:
        partial.unlink(missing_ok=True)
        raise PullError(f"the Hub sent more than the {size} bytes announced for {target.describe(file)}: the "
                        "download was stopped there and its partial file deleted; check HF_ENDPOINT, whose server "
                        "sends other bytes than it announces") from None
    except SymlinkInStore as exc:
        raise PullError(str(exc)) from None
    except KeyboardInterrupt:
        raise interrupted(target, f"{size_text(file_size(partial))} of {name}") from None
    except httpx2.ReadTimeout:
        raise PullError(f"the download of {target.describe(file)} stalled: nothing arrived for "
                        f"{constants.HF_HUB_DOWNLOAD_TIMEOUT} s, again after each of the Hub client's retries "
                        f"(HF_HUB_DOWNLOAD_TIMEOUT); {size_text(file_size(partial))} kept, run the same command "
                        "again to resume") from None
    except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled) as exc:
        raise hub_failure(exc, target.repo, target.revision, endpoint, file=file, resumable=True) from None
    except OSError as exc:
        if exc.errno is None:  # http_get's size check: the bytes received do not make the file announced
            partial.unlink(missing_ok=True)
            raise PullError(f"download of {target.describe(file)} did not match its announced size; the partial "
                            "file was deleted, run the command again") from None
        raise PullError(f"cannot write {partial}: {exc.strerror}; run the same command again to resume") from None


def interrupted(target: PullTarget, where: str) -> PullError:
    return PullError(f"pull of {target.model_id} interrupted at {where}; run the same command again to resume",
                     exit_code=130)


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


def hub_failure(exc: Exception, repo: str, revision: str, endpoint: str | None, *, file: str | None = None,
                resumable: bool = False) -> PullError:
    """One line for what the Hub client raised."""
    hub = endpoint_text(endpoint)
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



def drop_other_partials(partial_dir: Path, keep: Path) -> None:
    """Clear the id's partial directory of every download in progress but `keep`'s: another GGUF
    file, or an MLX repo at another commit (the pull lock is held; no symlink is in it)."""
    partial_dir.mkdir(parents=True, exist_ok=True)
    for stale in partial_dir.iterdir():
        if stale == keep:
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)


def already(stored: StoredModel, progress: TextIO) -> StoredModel:
    say(progress, f"{stored.id} is already in the model store")
    return stored


def same_source(stored: StoredModel, target: PullTarget) -> bool:
    source = stored.manifest.source
    return stored.format == target.format and source is not None and (
        source.repo, source.file, source.revision) == (target.repo, target.file, target.revision)


def endpoint_text(endpoint: str | None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0



def say(progress: TextIO, line: str) -> None:
    progress.write(line + "\n")
    progress.flush()
