"""In-process llama.cpp (llama-cpp-python): any GGUF file, one engine per model.

Each model in memory has a chat engine (`llama_engine`: one context, a slot per concurrent request,
batched decoding, prefix reuse) and, once embeddings are asked for, an embeddings engine
(`llama_embeddings`). A request's body is checked on the event loop; its prompt is rendered and
tokenized on a worker thread, which hands the engine a sequence; the engine's thread streams the
chunks back to the event loop through an asyncio queue.

Usage counting: prompt tokens are the templated prompt's tokens, `cached_tokens` those of them the
engine found in a slot's cache, completion tokens every sampled token except an end-of-generation
one. The counts are kept current in the request's `UsageMeter` as they change, so a request stopped
early reports the tokens really used; the meter's `end()` comes once the engine has let go of it
(a cancel is seen at the engine's next step).

Every engine offloads the layers `gpu_offload` decided to the machine's GPU (all of them when the
build can: Metal, CUDA, …; none on a CPU build or with `--gpu-layers 0`); `device` says where.

Engines are in memory only while they are used (`residency`): a model loads on its first
request and unloads after `keep_alive` idle seconds, within the node's memory budget
(`memory_fit`). At start, chat engines load in config order while they fit; a model that cannot
fit in the budget even alone is refused before anything loads (`memory_fit.ModelDoesNotFit`).

Error messages are our own sentences: a library or chat-template exception can quote the prompt,
and `BackendError.message` leaves the node unsealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from darkbloom.provider.backends.base import (TEXT_MODEL_CAPABILITIES, BackendError, Cancelled, Generation,
                                              UsageMeter, new_completion_id, request_priority, usage_chunk)
from darkbloom.provider.backends.llama_chat import chat_job, chat_sequence
from darkbloom.provider.backends.llama_embeddings import EmbeddingEngine, EmbeddingRequest
from darkbloom.provider.backends.llama_engine import Engine, Sequence
from darkbloom.provider.backends.residency import Residency
from darkbloom.provider.backends.llama_text import completion_sequence, embedding_job, embedding_tokens
from darkbloom.provider.backends.params import completion_job, require_object
from darkbloom.provider.config import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_CONCURRENCY, ConfigError
from darkbloom.provider.gpu_offload import CPU, METAL, GpuPlan, decide_offload, probe_build
from darkbloom.provider.memory_fit import EngineKind, MemoryBudget, estimate, memory_budget, refuse_unfit
from darkbloom.provider.models import read_gguf_metadata

log = logging.getLogger(__name__)
Prepare = Callable[[Engine | EmbeddingEngine, Generation, Callable[[dict[str, Any]], None]],
                   Sequence | EmbeddingRequest]


class LlamaCppBackend:
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
        self.models = dict(models)
        self.max_concurrency = max_concurrency
        self.n_ctx = n_ctx
        self.n_threads = n_threads or os.cpu_count() or 1
        self.extra_buffer_types = extra_buffer_types  # llama.cpp's repacked-weight kernels (`llama_model`)
        self.gpu = gpu if gpu is not None else decide_offload(None, probe_build())
        self.device = self.gpu.device
        if self.gpu.warning:
            log.warning("%s", self.gpu.warning)
        self._n_vocab: dict[str, int] = {}  # known once a model has loaded, kept across unloads
        self._own_pooling: dict[Path, bool] = {}  # whether the GGUF says how to pool its embeddings
        needs = []
        for model_id, path in self.models.items():
            metadata = read_gguf_metadata(path)
            if not metadata:
                raise ConfigError(f"model file for {model_id!r} is not a GGUF file: {path}")
            self._own_pooling[path] = f"{metadata.get('general.architecture', '')}.pooling_type" in metadata
            needs += [(kind, estimate(model_id, path, n_ctx, max_concurrency, kind, metadata))
                      for kind in ("chat", "embedding")]
        self.memory = memory if memory is not None else memory_budget()
        refuse_unfit([need for kind, need in needs if kind == "chat"], self.memory)
        self._residency: Residency[Engine | EmbeddingEngine] = Residency(needs, self._open_engine, self.memory,
                                                                             keep_alive)
        self._active: set[Generation] = set()
        self._executor: ThreadPoolExecutor | None = None

    def _load(self, model_id: str, kind: EngineKind) -> Engine | EmbeddingEngine:
        path = self.models[model_id]
        if kind == "chat":
            return Engine(model_id, path, slots=self.max_concurrency, n_ctx=self.n_ctx, n_threads=self.n_threads,
                          gpu_layers=self.gpu.layers, extra_buffer_types=self.extra_buffer_types)
        return EmbeddingEngine(model_id, path, n_threads=self.n_threads, own_pooling=self._own_pooling[path],
                               gpu_layers=self.gpu.layers, extra_buffer_types=self.extra_buffer_types)

    async def start(self) -> None:
        """Load the models that fit, in config order (a bad file among them fails here)."""
        self._executor = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="llama-prompt")
        for model_id in self.models:
            await self._residency.preload(model_id)
        on_demand = [model_id for model_id in self.models if model_id not in self.loaded_models()]
        log.info("llama.cpp backend ready on %s: %s loaded%s (%d sequences per model, %d threads; memory %s)",
                 self.gpu.describe(), ", ".join(self.loaded_models()) or "no model",
                 f", {', '.join(on_demand)} on demand" if on_demand else "", self.max_concurrency,
                 self.n_threads, self._residency.used_text())

    async def close(self) -> None:
        for generation in list(self._active):
            generation.cancel.set()
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None
        await self._residency.close()

    def capabilities(self, model_id: str) -> frozenset[str]:
        return TEXT_MODEL_CAPABILITIES if model_id in self.models else frozenset()

    def loaded_models(self) -> list[str]:
        """The model ids in memory now (a request for another one waits for its load)."""
        return self._residency.loaded_models()

    def watch_loaded(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop after a model loads or unloads."""
        self._residency.watch(callback)

    async def _open_engine(self, model_id: str, kind: EngineKind) -> Engine | EmbeddingEngine:
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

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        job = chat_job(require_object(body), self._n_vocab.get(model_id), self.n_ctx)
        n_ctx = self.n_ctx

        def prepare(engine: Engine | EmbeddingEngine, generation: Generation,
                    emit: Callable[[dict[str, Any]], None]) -> Sequence:
            return chat_sequence(engine.model, job, n_ctx, generation, emit)

        async with _closing(self._stream("chat", model_id, prepare, meter, "chatcmpl", "chat.completion.chunk",
                                         "messages")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_completion(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        job = completion_job(body, self._n_vocab.get(model_id))
        n_ctx = self.n_ctx

        def prepare(engine: Engine | EmbeddingEngine, generation: Generation,
                    emit: Callable[[dict[str, Any]], None]) -> Sequence:
            return completion_sequence(engine.model, job, n_ctx, generation, emit)

        async with _closing(self._stream("chat", model_id, prepare, meter, "cmpl", "text_completion",
                                         "prompt")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_embeddings(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        inputs = embedding_job(body)

        def prepare(engine: Engine | EmbeddingEngine, generation: Generation,
                    emit: Callable[[dict[str, Any]], None]) -> EmbeddingRequest:
            def vector(index: int, values: list[float]) -> None:
                emit({"object": "list", "data": [{"object": "embedding", "index": index, "embedding": values}]})
            return EmbeddingRequest(embedding_tokens(engine.model, inputs, generation), generation, vector,
                                    lambda error: None)

        async with _closing(self._stream("embedding", model_id, prepare, meter, "embd", "list", "input")) as stream:
            async for chunk in stream:
                yield chunk

    def _served(self, model_id: str) -> None:
        if model_id not in self.models:
            raise BackendError(404, f"model {model_id!r} is not served by this node", param="model")

    async def _stream(self, kind: EngineKind, model_id: str, prepare: Prepare, meter: UsageMeter | None,
                      id_prefix: str, object_name: str, param: str) -> AsyncIterator[dict[str, Any]]:
        """Prepare the request on a worker thread against `model_id`'s `kind` engine (loading it first if
        it is not in memory) and hand it to the engine; yield what it emits, then the usage chunk.
        Closing this early stops the work at the engine's next step."""
        if self._executor is None:
            raise BackendError(503, "the llama.cpp backend is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def to_loop(callback: Callable[[Any], None], item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(callback, item)

        lease = await self._residency.lease(model_id, kind)  # held until the engine is done with the request
        generation = Generation(model_id=model_id, meter=meter if meter is not None else UsageMeter(),
                                background=request_priority.get() == "batch")

        def handed_back(error: BaseException | None) -> None:  # on the loop, once nothing works on it any more
            generation.cancelled = isinstance(error, Cancelled)
            lease.release()
            generation.meter.end()
            self._ended(generation)
            queue.put_nowait(("error", error) if error is not None and not isinstance(error, Cancelled)
                             else ("done", None))

        def emit(chunk: dict[str, Any]) -> None:
            if not generation.cancel.is_set():
                to_loop(queue.put_nowait, ("chunk", chunk))

        executor = self._executor
        if executor is None:
            lease.release()
            raise BackendError(503, "the llama.cpp backend is shut down")
        self._active.add(generation)
        generation.meter.begin()
        try:
            executor.submit(self._prepare, lease.engine, prepare, generation, emit, param,
                            lambda error: to_loop(handed_back, error))
        except RuntimeError:
            self._active.discard(generation)
            handed_back(None)
            raise BackendError(503, "the llama.cpp backend is shut down") from None
        completion_id, created = new_completion_id(id_prefix), None
        try:
            while True:
                what, item = await queue.get()
                if what == "error":
                    raise item
                if what == "done":
                    break
                created = item.get("created", created)
                item["id"], item["model"] = completion_id, model_id
                yield item
        finally:
            generation.cancel.set()  # no-op when the work already ended
            self._active.discard(generation)
        yield usage_chunk(completion_id, model_id, created, generation.prompt_tokens, generation.completion_tokens,
                          object_name=object_name,
                          cached_tokens=None if kind == "embedding" else generation.cached_tokens)

    def _prepare(self, engine: Engine | EmbeddingEngine, prepare: Prepare, generation: Generation,
                 emit: Callable[[dict[str, Any]], None], param: str,
                 finished: Callable[[BaseException | None], None]) -> None:
        """Worker thread: render and tokenize the request, then hand it to the engine, which calls
        `finished` once it is done with it (at once when the request fails here)."""
        import jinja2

        try:
            work = prepare(engine, generation, emit)
        except (Cancelled, BackendError) as exc:
            finished(exc)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            finished(BackendError(400, _invalid_request_message(exc), param=param))
        except Exception as exc:
            log.exception("preparing a llama.cpp request failed")
            finished(BackendError(500, f"generation failed ({type(exc).__name__})"))
        else:
            work.finished = finished
            engine.submit(work)  # type: ignore[arg-type]

    def _ended(self, generation: Generation) -> None:
        """On the event loop, once the engine has let go of `generation` (tests record it here)."""


def _closing(stream: AsyncIterator[dict[str, Any]]) -> contextlib.AbstractAsyncContextManager[Any]:
    """Close the inner stream as soon as the outer one is closed (stops its work within one token)."""
    return contextlib.aclosing(stream)  # type: ignore[type-var]


_CONTEXT_OVERFLOW = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")


def _invalid_request_message(exc: Exception) -> str:
    """Our own sentence for a request llama.cpp rejected; never the exception's text (it can quote the
    prompt: a chat template's error, a tokenizer's complaint). Only numbers are taken from it."""
    import jinja2

    if overflow := _CONTEXT_OVERFLOW.search(str(exc)):
        return f"the prompt is {overflow[1]} tokens, too long for this model's context window of {overflow[2]}"
    if "context window" in str(exc):
        return "the request does not fit in this model's context window"
    if isinstance(exc, jinja2.TemplateError):
        return "this model's chat template rejected the messages (check the roles and their order)"
    return "the request is not valid for this model"
