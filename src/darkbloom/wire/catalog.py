"""The model catalog: ids, aliases, prices (µUSD per 1M tokens), output bounds, and where each
model's weights come from (docs/models.md)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUNDLED_MODEL_ID = "smollm2-135m"
DEFAULT_MAX_OUTPUT_TOKENS = 4096


MAX_MODEL_ID = 256  # the longest model id anything accepts (catalog, requests, what a node advertises)
WEIGHT_HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"
_GGUF_FILE = r"[^\\]+\.gguf"  # a GGUF source file: no backslash, something before the suffix


class WeightSource(BaseModel):
    """Where a catalog model's weights live on the Hugging Face Hub: a GGUF file of a repo, or a repo
    holding an MLX model, taken whole (no `file`)."""
    model_config = ConfigDict(extra="forbid")

    repo: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    file: str | None = Field(default=None, max_length=500)
    revision: str = Field(default="main", min_length=1, max_length=200)

    @field_validator("file")
    @classmethod
    def _empty_is_none(cls, file: str | None) -> str | None:
        return file or None


class CatalogModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_MODEL_ID)
    aliases: list[str] = Field(default_factory=list)
    format: Literal["gguf", "mlx"] = "gguf"  # of the weights: a GGUF file, or an MLX model directory
    input_price: int = Field(ge=0, description="µUSD per 1M prompt tokens")
    output_price: int = Field(ge=0, description="µUSD per 1M completion tokens")
    max_output_tokens: int = Field(default=DEFAULT_MAX_OUTPUT_TOKENS, ge=1)
    weight_hash: str | None = Field(default=None, pattern=WEIGHT_HASH_PATTERN)
    source: WeightSource | None = None
    size_bytes: int | None = Field(default=None, ge=0)
    context_length: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _source_of_format(self) -> "CatalogModel":
        """A GGUF model's source names its .gguf file; an MLX model's names the repo (and revision) only."""
        file = self.source.file if self.source is not None else None
        if self.source is not None and self.format == "gguf" and not (file and re.fullmatch(_GGUF_FILE, file)):
            raise ValueError(f"model {self.id!r}: a gguf model's source needs its file, a name ending in .gguf "
                             "with no backslash")
        if file is not None and self.format == "mlx":
            raise ValueError(f"model {self.id!r}: an mlx model's source names its repo only (the whole model "
                             "directory is pulled), not a file")
        return self

    def verifies(self, weight_hash: str) -> bool:
        """Whether weights with this hash are the ones the catalog names (any are, without a pin)."""
        return self.weight_hash is None or weight_hash == self.weight_hash

    def cost(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Raw cost in µUSD, before any minimum charge (docs/billing.md "Money")."""
        return _ceil_per_million(prompt_tokens * self.input_price) + _ceil_per_million(
            completion_tokens * self.output_price)


def _ceil_per_million(micro_usd_per_million: int) -> int:
    """ceil(x / 1e6) in integer arithmetic: money is never a float."""
    return -(-micro_usd_per_million // 1_000_000)


class Catalog(BaseModel):
    models: list[CatalogModel]

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[CatalogModel]) -> list[CatalogModel]:
        seen: set[str] = set()
        for model in models:
            for name in (model.id, *model.aliases):
                if name in seen:
                    raise ValueError(f"model name {name!r} appears twice in the catalog")
                seen.add(name)
        return models

    def resolve(self, name: str) -> CatalogModel | None:
        """The catalog entry for an id or alias, or None."""
        for model in self.models:
            if name == model.id or name in model.aliases:
                return model
        return None

    def unverified(self, advertised: Iterable[tuple[str, str]]) -> list[str]:
        """Of the advertised (id, weight_hash) pairs, the ids whose weights differ from the catalog's
        pin for that id, sorted (docs/models.md "Verified weights")."""
        found = set()
        for model_id, weight_hash in advertised:
            model = self.resolve(model_id)
            if model is not None and not model.verifies(weight_hash):
                found.add(model_id)
        return sorted(found)

    @classmethod
    def default(cls) -> "Catalog":
        return cls(models=[CatalogModel(id=BUNDLED_MODEL_ID, input_price=50_000, output_price=200_000,
                                        max_output_tokens=2048)])

    @classmethod
    def load(cls, path: Path) -> "Catalog":
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        return cls.model_validate(data)
