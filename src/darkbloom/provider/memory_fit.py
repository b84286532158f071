"""Will it fit: the memory a model needs on this node, and the memory the node may use.

A GGUF model's need is its file (mapped once, by its chat and embeddings engines alike) plus, for its
chat engine, llama.cpp's f16 KV cache for `max_concurrency` windows of the served context and one
set of compute buffers measured on the bundled model (docs/models.md "Will it fit"). An MLX model's
is its safetensors plus mlx-lm's 16-bit KV cache for as many windows (`mlx_model`). The budget is the
machine's RAM, or its cgroup limit when smaller, unless the owner set `--max-memory-gb`. It holds with
Metal (Apple silicon's GPU shares the RAM); a CUDA GPU's own memory is not checked (docs/models.md
"The GPU" says why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from darkbloom.provider import mlx_model
from darkbloom.provider.config import ConfigError, ProviderConfig, resolve_model_path
from darkbloom.provider.models import read_gguf_metadata

GIB = 2**30
MIB = 2**20
KV_BYTES = 2  # llama.cpp's default KV cache type is f16
# What an engine holds beyond its KV cache, measured on the bundled model (docs/models.md "Will it
# fit"): a chat engine's compute buffers; an embeddings engine evaluates up to 512 tokens at once with
# every row an output.
CHAT_BUFFERS = 40 * MIB
EMBEDDING_BUFFERS = 224 * MIB
EMBEDDING_CELLS = 512  # `llama_embeddings.BATCH`
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))

EngineKind = Literal["chat", "embedding"]


class ModelDoesNotFit(ConfigError):
    """A configured model needs more memory than the node may use."""


@dataclass(frozen=True)
class MemoryNeed:
    """What one engine of a model needs: the file, and its context (KV cache + buffers); a chat engine's
    for `sequences` requests at once (0 for an embeddings engine, which takes inputs as they fit)."""

    model_id: str
    file_bytes: int
    context_bytes: int
    sequences: int

    @property
    def total(self) -> int:
        return self.file_bytes + self.context_bytes

    def describe(self) -> str:
        total = self.total
        requests = "" if not self.sequences else " for 1 request" if self.sequences == 1 else \
            f" for {self.sequences} requests"
        return (f"{size_text(total)} ({size_text(self.file_bytes, total)} file + "
                f"{size_text(self.context_bytes, total)} context{requests})")


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    source: str  # where the number comes from, for messages: "--max-memory-gb", "RAM", "cgroup limit"

    def describe(self) -> str:
        return f"{size_text(self.total_bytes)} ({self.source})"

    @property
    def gb(self) -> float:
        return round(self.total_bytes / GIB, 1)


def kv_cache_bytes(metadata: dict[str, Any], n_ctx: int) -> int:
    """llama.cpp's f16 KV cache of one instance with `n_ctx` cells: every layer keeps a key and a value
    row per cell and KV head. 0 when the metadata does not say (not a transformer llama.cpp knows)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return 0

    def number(key: str) -> int | None:
        value = metadata.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    n_layer, n_head, n_embd = number("block_count"), number("attention.head_count"), number("embedding_length")
    if n_layer is None or n_head is None or n_embd is None:
        return 0
    n_head_kv = number("attention.head_count_kv") or n_head
    head_dim = n_embd // n_head
    key_length = number("attention.key_length") or head_dim
    value_length = number("attention.value_length") or head_dim
    return n_layer * n_ctx * n_head_kv * (key_length + value_length) * KV_BYTES


def estimate(model_id: str, path: Path, n_ctx: int, sequences: int, kind: EngineKind = "chat",
             metadata: dict[str, Any] | None = None) -> MemoryNeed:
    """The memory an engine of `path` needs: a chat engine serving `sequences` requests of `n_ctx`
    tokens at once, or an embeddings engine (one batch of EMBEDDING_CELLS)."""
    if path.is_dir():  # an MLX model: its safetensors, and mlx-lm's KV cache per sequence
        config = mlx_model.read_config(path)
        return MemoryNeed(model_id, mlx_model.weights_bytes(path),
                          mlx_model.kv_cache_bytes(config, n_ctx) * sequences + CHAT_BUFFERS, sequences)
    metadata = read_gguf_metadata(path) if metadata is None else metadata
    if kind == "chat":
        context = kv_cache_bytes(metadata, n_ctx * sequences) + CHAT_BUFFERS
    else:
        context, sequences = kv_cache_bytes(metadata, EMBEDDING_CELLS) + EMBEDDING_BUFFERS, 0
    return MemoryNeed(model_id, path.stat().st_size, context, sequences)


def memory_budget(max_memory_gb: float | None = None) -> MemoryBudget:
    """`--max-memory-gb` when given, else what this machine has (`detected_memory`)."""
    if max_memory_gb is not None:
        return MemoryBudget(int(max_memory_gb * GIB), "--max-memory-gb")
    return detected_memory()


def detected_memory(cgroup_limits: tuple[Path, ...] = CGROUP_LIMITS) -> MemoryBudget:
    """The machine's RAM, or the cgroup's memory limit when that is smaller (a container)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    budget = MemoryBudget(ram, "RAM")
    for path in cgroup_limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) and (ram == 0 or int(text) < ram):
            budget = MemoryBudget(int(text), "cgroup limit")
        break
    return budget


def refuse_unfit(needs: list[MemoryNeed], budget: MemoryBudget) -> None:
    """Raise `ModelDoesNotFit` for the largest model when it alone cannot fit in `budget`."""
    if not needs or budget.total_bytes <= 0:
        return
    largest = max(needs, key=lambda need: need.total)
    if largest.total > budget.total_bytes:
        raise ModelDoesNotFit(too_large_message(largest, budget))


def refuse_unfit_models(config: ProviderConfig) -> None:
    """What an in-process backend refuses at construction, from the configuration alone."""
    if config.backend == "openai":
        return
    sequences = serving_concurrency(config)
    needs = [estimate(spec.id, resolve_model_path(spec), config.context_length, sequences) for spec in config.models]
    refuse_unfit(needs, memory_budget(config.max_memory_gb))


def serving_concurrency(config: ProviderConfig) -> int:
    """The requests a node serves at once: its owner's `max_concurrency`, else the default, or fewer for
    an in-process node where a model would not fit with that many windows (1 at least; `refuse_unfit_models`
    then says why)."""
    if config.max_concurrency_chosen or config.backend == "openai":
        return config.max_concurrency
    budget = memory_budget(config.max_memory_gb)
    try:
        paths = [(spec.id, resolve_model_path(spec)) for spec in config.models]
        for sequences in range(config.max_concurrency, 1, -1):
            needs = [estimate(model_id, path, config.context_length, sequences) for model_id, path in paths]
            if budget.total_bytes <= 0 or all(need.total <= budget.total_bytes for need in needs):
                return sequences
    except OSError:  # a file that is not there: its load says so
        return config.max_concurrency
    return 1


def too_large_message(need: MemoryNeed, budget: MemoryBudget, kind: EngineKind = "chat") -> str:
    purpose = " for embeddings" if kind == "embedding" else ""
    return f"model {need.model_id} needs {need.describe()}{purpose}; this machine has {budget.describe()}"


def size_text(size: int, unit_of: int | None = None) -> str:
    """GB (2^30 bytes) with one decimal from 1 GB up, else whole MB (2^20); the unit `unit_of` would
    have, when given (the parts of a sum in the sum's unit)."""
    return f"{size / GIB:.1f} GB" if (size if unit_of is None else unit_of) >= GIB else f"{size / MIB:.0f} MB"
