"""`darkbloom models list`: every model this node can serve — the bundled one, the pulled ones, the
ones provider.toml or --model names — and whether the coordinator's catalog lists each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darkbloom.provider.bundled_model import BundledModelMissing, bundled_gguf_path
from darkbloom.provider.config import ProviderConfig
from darkbloom.provider.mlx_model import files_bytes
from darkbloom.provider.model_store import ModelStore
from darkbloom.provider.models import HASH_CACHE_NAME, weight_hash
from darkbloom.wire.catalog import BUNDLED_MODEL_ID, Catalog


@dataclass(frozen=True)
class ServableModel:
    id: str
    source: str  # "bundled", "store" (pulled, or named but not pulled: file None), "file" (ID=PATH), "upstream"
    file: Path | None
    size_bytes: int | None
    weight_hash: str | None
    configured: bool  # `darkbloom serve` with no --model serves it
    in_catalog: bool | None  # None: no coordinator's catalog to ask

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "file": str(self.file) if self.file else None,
                "size_bytes": self.size_bytes, "weight_hash": self.weight_hash, "configured": self.configured,
                "in_catalog": self.in_catalog}


def servable_models(config: ProviderConfig, store: ModelStore, catalog: Catalog | None) -> list[ServableModel]:
    """The bundled model, the store's, then the configured ones not listed yet. `config` may hold
    ids the store lacks (ModelNotPulled.config): they are listed without a file."""
    hash_cache = store.home / HASH_CACHE_NAME
    configured = set(config.model_ids)
    found: dict[str, tuple[str, Path | None]] = {}
    try:
        found[BUNDLED_MODEL_ID] = ("bundled", bundled_gguf_path())
    except BundledModelMissing:
        pass
    for stored in store.models():
        found[stored.id] = ("store", stored.path)
    for spec in config.models:
        if config.backend == "openai":
            found.setdefault(spec.id, ("upstream", None))
        elif not spec.path:  # an id the store lacks
            found.setdefault(spec.id, ("store", None))
        elif spec.id not in found or found[spec.id][1] != Path(spec.path):  # ID=PATH
            found[spec.id] = ("file", Path(spec.path).expanduser())
    return [_describe(model_id, source, path, hash_cache, model_id in configured,
                      catalog.resolve(model_id) is not None if catalog else None)
            for model_id, (source, path) in found.items()]


def _describe(model_id: str, source: str, path: Path | None, hash_cache: Path, configured: bool,
              in_catalog: bool | None) -> ServableModel:
    size = digest = None
    if path is not None:
        try:
            resolved = path.resolve()
            size = files_bytes(resolved) if resolved.is_dir() else resolved.stat().st_size  # an MLX directory
            digest = weight_hash(resolved, hash_cache)
        except OSError:
            pass
    return ServableModel(model_id, source, path, size, digest, configured, in_catalog)
