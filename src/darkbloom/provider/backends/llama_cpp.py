"""In-process llama.cpp (llama-cpp-python): any GGUF file, one engine per model.

Each model in memory has a chat engine (`llama_engine`: one context, a slot per concurrent request,
batched decoding, prefix reuse) and, once embeddings are asked for, an embeddings engine
(`llama_embeddings`). How a request reaches its engine and streams back, and how its usage is
counted: `in_process`.

Every engine offloads the layers `gpu_offload` decided to the machine's GPU (all of them when the
build can: Metal, CUDA, …; none on a CPU build or with `--gpu-layers 0`); `device` says where.

Engines are in memory only while they are used (`residency`): a model loads on its first
request and unloads after `keep_alive` idle seconds, within the node's memory budget
(`memory_fit`). At start, chat engines load in config order while they fit; a model that cannot
fit in the budget even alone is refused before anything loads (`memory_fit.ModelDoesNotFit`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable

from darkbloom.provider.backends.base import TEXT_MODEL_CAPABILITIES, BackendError, Generation
from darkbloom.provider.backends.in_process import InProcessBackend, Prepare
from darkbloom.provider.backends.llama_chat import chat_job, chat_sequence
from darkbloom.provider.backends.llama_embeddings import EmbeddingEngine, EmbeddingRequest
from darkbloom.provider.backends.llama_engine import Engine, Sequence
from darkbloom.provider.backends.llama_text import completion_sequence, embedding_job, embedding_tokens
from darkbloom.provider.backends.params import completion_job, require_object
from darkbloom.provider.config import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_CONCURRENCY, ConfigError
from darkbloom.provider.gpu_offload import CPU, METAL, GpuPlan, decide_offload, probe_build
from darkbloom.provider.memory_fit import EngineKind, MemoryBudget, estimate, memory_budget, refuse_unfit
from darkbloom.provider.models import read_gguf_metadata

log = logging.getLogger(__name__)
Engines = Engine | EmbeddingEngine


class LlamaCppBackend(InProcessBackend[Engines]):
    name = "llama.cpp"

    def __init__(self, models: dict[str, Path], *, max_concurrency: int = DEFAULT_MAX_CONCURRENCY, n_ctx: int = 2048,
                 n_threads: int = 0, extra_buffer_types: bool = False, memory: MemoryBudget | None = None,
                 keep_alive: float = DEFAULT_KEEP_ALIVE, gpu: GpuPlan | None = None) -> None:
        """`max_concurrency`: the sequences each chat engine runs at once; `n_ctx`: each one's window;
        `n_threads`: llama.cpp's threads per engine (default: every core); `memory`: the budget for
        models (default: this machine's, `memory_fit.memory_budget`); `keep_alive`: idle seconds
        before a model unloads (0: when its last request ends; negative: only when another model
        needs the memory); `gpu`: the layers every engine offloads, and where (default: every layer
        when this build can, `gpu_offload`). Raises `ConfigError` (`ModelDoesNotFit`) for a file that
        is not GGUF or a model that cannot fit."""
        self.n_threads = n_threads or os.cpu_count() or 1
        self.extra_buffer_types = extra_buffer_types  # llama.cpp's repacked-weight kernels (`llama_model`)
        self.gpu = gpu if gpu is not None else decide_offload(None, probe_build())
        self.device = self.gpu.device
        if self.gpu.warning:
            log.warning("%s", self.gpu.warning)
        self._n_vocab: dict[str, int] = {}  # known once a model has loaded, kept across unloads
        self._own_pooling: dict[Path, bool] = {}  # whether the GGUF says how to pool its embeddings
        needs = []
        for model_id, path in models.items():
            metadata = read_gguf_metadata(path)
            if not metadata:
                raise ConfigError(f"model file for {model_id!r} is not a GGUF file: {path}")
            self._own_pooling[path] = f"{metadata.get('general.architecture', '')}.pooling_type" in metadata
            needs += [(kind, estimate(model_id, path, n_ctx, max_concurrency, kind, metadata))
                      for kind in ("chat", "embedding")]
        memory = memory if memory is not None else memory_budget()
        refuse_unfit([need for kind, need in needs if kind == "chat"], memory)
        super().__init__(models, max_concurrency=max_concurrency, n_ctx=n_ctx, needs=needs, memory=memory,
                         keep_alive=keep_alive)

    def _load(self, model_id: str, kind: EngineKind) -> Engines:
        path = self.models[model_id]
        if kind == "chat":
            return Engine(model_id, path, slots=self.max_concurrency, n_ctx=self.n_ctx, n_threads=self.n_threads,
                          gpu_layers=self.gpu.layers, extra_buffer_types=self.extra_buffer_types)
        return EmbeddingEngine(model_id, path, n_threads=self.n_threads, own_pooling=self._own_pooling[path],
                               gpu_layers=self.gpu.layers, extra_buffer_types=self.extra_buffer_types)

    def _ready_line(self) -> str:
        return f" on {self.gpu.describe()} ({self.n_threads} threads)"

    def capabilities(self, model_id: str) -> frozenset[str]:
        return TEXT_MODEL_CAPABILITIES if model_id in self.models else frozenset()

    async def _open_engine(self, model_id: str, kind: EngineKind) -> Engines:
        """A new engine, its model loaded (a bad file fails here)."""
        try:
            engine = await asyncio.to_thread(self._load, model_id, kind)
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendError(500, f"cannot load model {model_id!r} from {self.models[model_id]}: {exc}"
                                    f"{self._load_hint()}") from None
        self._n_vocab[model_id] = engine.model.n_vocab()
        return engine

    def _load_hint(self) -> str:
        """What to try when a load fails on a GPU with memory of its own, which is not checked before the
        load (docs/models.md "The GPU"); nothing on the CPU or Metal (the RAM, checked)."""
        if self.device in (CPU, METAL):
            return ""
        return "; if the GPU ran out of memory, serve with fewer --gpu-layers or a lower --max-concurrency"

    def _chat(self, model_id: str, body: dict[str, Any]) -> Prepare[Engines]:
        job = chat_job(require_object(body), self._n_vocab.get(model_id), self.n_ctx)
        n_ctx = self.n_ctx

        def prepare(engine: Engines, generation: Generation, emit: Callable[[dict[str, Any]], None]) -> Sequence:
            assert isinstance(engine, Engine)
            return chat_sequence(engine.model, job, n_ctx, generation, emit)

        return prepare

    def _completion(self, model_id: str, body: dict[str, Any]) -> Prepare[Engines]:
        job = completion_job(body, self._n_vocab.get(model_id))
        n_ctx = self.n_ctx

        def prepare(engine: Engines, generation: Generation, emit: Callable[[dict[str, Any]], None]) -> Sequence:
            assert isinstance(engine, Engine)
            return completion_sequence(engine.model, job, n_ctx, generation, emit)

        return prepare

    def _embeddings(self, model_id: str, body: dict[str, Any]) -> Prepare[Engines]:
        inputs = embedding_job(body)

        def prepare(engine: Engines, generation: Generation,
                    emit: Callable[[dict[str, Any]], None]) -> EmbeddingRequest:
            def vector(index: int, values: list[float]) -> None:
                emit({"object": "list", "data": [{"object": "embedding", "index": index, "embedding": values}]})
            return EmbeddingRequest(embedding_tokens(engine.model, inputs, generation), generation, vector,
                                    lambda error: None)

        return prepare
