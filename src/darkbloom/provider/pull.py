"""`darkbloom models pull`: a model of the coordinator's catalog, or a Hub repo's GGUF file or MLX
model, downloaded into the model store — resumable, checked, never half-installed (docs/models.md
"Pulling a model"). What to pull is decided here; `pull_gguf` and `pull_mlx` download it."""

from __future__ import annotations

import sys
from pathlib import PurePosixPath
from typing import TextIO
from urllib.parse import urlsplit

import httpx
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from pydantic import ValidationError

from darkbloom.provider.hub_transfer import PullError, PullTarget, repo_info
from darkbloom.provider.model_store import (InvalidModelId, ModelStore, NoRoom, StoredModel, StoreBusy, SymlinkInStore,
                                             check_model_id)
from darkbloom.provider.pull_gguf import check_gguf_name, gguf_files, only_gguf, pull_gguf
from darkbloom.provider.pull_mlx import mlx_files, pull_mlx
from darkbloom.wire.catalog import BUNDLED_MODEL_ID, Catalog, CatalogModel

_CATALOG_TIMEOUT = 10.0


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
    are ignored, and entries it cannot read (a weight format it does not know) left out, so a newer
    coordinator's catalog still reads."""
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
        models = []
        for entry in entries:
            try:
                models.append(CatalogModel.model_validate(
                    {key: value for key, value in entry.items() if key in CatalogModel.model_fields}))
            except ValidationError:
                continue
        return Catalog(models=models)
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
    file = entry.source.file or ""
    if entry.format == "gguf":
        check_gguf_name(file, "tell the coordinator's operator")
    return PullTarget(model_id, entry.source.repo, file, entry.source.revision, format=entry.format,
                      weight_hash=entry.weight_hash, size_bytes=entry.size_bytes, catalog=coordinator_url)


def hub_target(name: str, *, file: str | None = None, revision: str | None = None, as_id: str | None = None,
               endpoint: str | None = None) -> PullTarget:
    """`owner/name`, `owner/name:file.gguf` or `owner/name --file F`. With no file named, a repo with
    one GGUF file pulls it, one with several exits 2 listing them, and one with none but an MLX model
    (`config.json` and safetensors) pulls that, stored by default under the repo's name lower-cased."""
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
    file = file or inline_file
    if not file:
        names = [sibling.rfilename for sibling in repo_info(repo, revision, endpoint).siblings or []]
        ggufs = gguf_files(names)
        if not ggufs and mlx_files(names) is not None:
            model_id = as_id if as_id is not None else repo.partition("/")[2].lower()
            return PullTarget(_store_id(model_id), repo, "", revision, format="mlx")
        if not ggufs:
            raise PullError(f"{repo} at {revision} holds no model a node serves: no .gguf file, and no MLX model "
                            "(config.json and .safetensors weights at its top level)")
        file = only_gguf(repo, ggufs)
    if not file.lower().endswith(".gguf"):
        raise PullError(f"{file!r} is not a .gguf file: name a GGUF file of the repo, or none to pull its MLX "
                        "model")
    check_gguf_name(file, "choose another file with --file")
    return PullTarget(_store_id(as_id if as_id is not None else PurePosixPath(file).stem.lower()), repo, file,
                      revision)


def _store_id(model_id: str) -> str:
    try:
        return check_model_id(model_id)
    except InvalidModelId as exc:
        raise PullError(str(exc)) from None


def pull(target: PullTarget, store: ModelStore, *, endpoint: str | None = None,
         progress: TextIO = sys.stderr) -> StoredModel:
    """Download `target` (resuming a partial download of it), verify it, and install it in the store
    in one rename, one pull at a time per store. No symlink under the store is followed. Raises
    PullError."""
    try:
        store.refuse_symlinks(target.model_id)
        with store.writing():
            pull_format = pull_mlx if target.format == "mlx" else pull_gguf
            return pull_format(target, store, store.partial_dir(target.model_id), endpoint, progress)
    except (SymlinkInStore, StoreBusy, NoRoom) as exc:
        raise PullError(str(exc)) from None


def _is_hub_name(name: str) -> bool:
    return "/" in name.partition(":")[0]
