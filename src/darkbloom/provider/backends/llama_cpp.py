"""In-process llama.cpp (llama-cpp-python): any GGUF file, a pool of instances per model.

A `llama_cpp.Llama` is not safe for concurrent use, so each model has up to `max_concurrency`
instances and a request checks one out exclusively. Generation is blocking and runs on a worker
thread; chunks come back to the event loop through an asyncio queue.

Usage counting: llama-cpp-python's streaming API reports no usage (only the non-streaming call
does). `_CountingLlama.generate` wraps the library's token loop, which receives the full prompt
token list (after the chat template) and yields every sampled token. Prompt tokens = the length of
that list; completion tokens = sampled tokens, minus the end-of-generation token when that is what
stopped it — the same numbers the library's non-streaming `usage` reports. The same wrapper checks
the cancel flag between tokens, so a cancelled request stops within one token. It also keeps the
request's `UsageMeter` current from the worker thread, so a request stopped early reports the
tokens really used: the templated prompt and the tokens sampled until it stopped. The meter's
`end()` comes once the worker has stopped and handed the instance back.

The same machinery serves chat (`llama_chat`), legacy completions and embeddings (`llama_text`):
the body is checked on the event loop before an instance is taken, the work runs on a worker
thread. Embeddings use a second pool per model, of instances loaded with `embedding=True`.
Logprobs need no special instance (`llama_decode`).

Every instance offloads the layers `gpu_offload` decided to the machine's GPU (all of them when the
build can: Metal, CUDA, …; none on a CPU build or with `--gpu-layers 0`); `device` says where.

Pools are in memory only while they are used (`llama_residency`): a model loads on its first
request and unloads after `keep_alive` idle seconds, within the node's memory budget
(`memory_fit`). At start, chat pools load in config order while they fit; a model whose pool cannot
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

import llama_cpp

from darkbloom.provider.backends.base import (TEXT_MODEL_CAPABILITIES, BackendError, UsageMeter,
                                              new_completion_id, usage_chunk)
from darkbloom.provider.backends.llama_chat import chat_job, run_chat
from darkbloom.provider.backends.llama_instances import Cancelled, CountingLlama, GenerationStats, Pool
from darkbloom.provider.backends.llama_residency import Residency
from darkbloom.provider.backends.llama_text import completion_job, embedding_job, run_completion, run_embeddings
from darkbloom.provider.backends.params import require_object
from darkbloom.provider.config import DEFAULT_KEEP_ALIVE, ConfigError
from darkbloom.provider.gpu_offload import CPU, METAL, GpuPlan, decide_offload, probe_build
from darkbloom.provider.memory_fit import MemoryBudget, PoolKind, estimate, memory_budget, refuse_unfit
from darkbloom.provider.models import read_gguf_metadata

log = logging.getLogger(__name__)
EMBEDDING_BATCH = 512  # the most tokens one embeddings input may have
Work = Callable[[CountingLlama, GenerationStats, Callable[[dict[str, Any]], None]], None]


class LlamaCppBackend:
    def __init__(self, models: dict[str, Path], *, max_concurrency: int = 2, n_ctx: int = 2048,
                 n_threads: int = 0, extra_buffer_types: bool = False, memory: MemoryBudget | None = None,
                 keep_alive: float = DEFAULT_KEEP_ALIVE, gpu: GpuPlan | None = None) -> None:
        """`memory`: the budget for models (default: this machine's, `memory_fit.memory_budget`);
        `keep_alive`: idle seconds before a model unloads (0: when its last request ends; negative:
        only when another model needs the memory); `gpu`: the layers every instance offloads, and
        where (default: every layer when this build can, `gpu_offload`). Raises `ConfigError`
        (`ModelDoesNotFit`) for a file that is not GGUF or a model that cannot fit."""
        self.models = dict(models)
        self.max_concurrency = max_concurrency
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, (os.cpu_count() or 1) // max_concurrency)
        self.extra_buffer_types = extra_buffer_types  # llama.cpp's repacked-weight kernels (`CountingLlama`)
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
        self._residency = Residency(needs, self._open_pool, self.memory, keep_alive)
        self._active: set[GenerationStats] = set()
        self._executor: ThreadPoolExecutor | None = None

    def _load(self, path: Path) -> CountingLlama:
        return CountingLlama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.n_threads,
                             n_threads_batch=self.n_threads, n_gpu_layers=self.gpu.layers,
                             extra_buffer_types=self.extra_buffer_types, verbose=False)

    def _load_embedding(self, path: Path) -> CountingLlama:
        # One input is one batch (pooling needs the whole sequence at once), so an input may have up to
        # EMBEDDING_BATCH tokens: a batch's compute memory grows with its size (~150 MB at 512 for the
        # bundled model, ~750 MB at 2048). A GGUF that names no pooling (a chat model) is mean-pooled.
        pooling = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if self._own_pooling.get(path) else \
            llama_cpp.LLAMA_POOLING_TYPE_MEAN
        batch = min(self.n_ctx, EMBEDDING_BATCH)
        return CountingLlama(model_path=str(path), n_ctx=self.n_ctx, n_batch=batch, n_ubatch=batch,
                             n_threads=self.n_threads, n_threads_batch=self.n_threads, n_gpu_layers=self.gpu.layers,
                             embedding=True, pooling_type=pooling, extra_buffer_types=self.extra_buffer_types,
                             verbose=False)

    async def start(self) -> None:
        """Load the models that fit, in config order (a bad file among them fails here)."""
        self._executor = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="llama")
        for model_id in self.models:
            await self._residency.preload(model_id)
        on_demand = [model_id for model_id in self.models if model_id not in self.loaded_models()]
        log.info("llama.cpp backend ready on %s: %s loaded%s (pool of %d per model, %d threads each; memory %s)",
                 self.gpu.describe(), ", ".join(self.loaded_models()) or "no model",
                 f", {', '.join(on_demand)} on demand" if on_demand else "", self.max_concurrency,
                 self.n_threads, self._residency.used_text())

    async def close(self) -> None:
        for stats in list(self._active):
            stats.cancel.set()
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

    async def _open_pool(self, model_id: str, kind: PoolKind) -> Pool:
        """A new pool with one instance loaded (a bad file fails here); the rest load as requests need them."""
        pool = Pool(model_id, self.models[model_id], self.max_concurrency,
                    self._load if kind == "chat" else self._load_embedding, self._load_hint())
        llama = await pool.acquire()
        self._n_vocab[model_id] = llama.n_vocab()
        pool.release(llama)
        return pool

    def _load_hint(self) -> str:
        """What to try when a load fails on a GPU with memory of its own, which is not checked before the
        load (docs/models.md "The GPU"); nothing on the CPU or Metal (the RAM, checked)."""
        if self.device in (CPU, METAL):
            return ""
        return ("; if the GPU ran out of memory, serve with fewer --gpu-layers or a lower --max-concurrency "
                "(each instance holds its own copy of the offloaded layers)")

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        job = chat_job(require_object(body), self._n_vocab.get(model_id), self.n_ctx)
        async with _closing(self._stream("chat", model_id, lambda llama, _s, emit: run_chat(llama, job, emit),
                                         meter, "chatcmpl", "chat.completion.chunk", "messages")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_completion(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        job = completion_job(body, self._n_vocab.get(model_id))
        async with _closing(self._stream("chat", model_id,
                                         lambda llama, _s, emit: run_completion(llama, job, emit), meter, "cmpl",
                                         "text_completion", "prompt")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_embeddings(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        inputs = embedding_job(body)
        async with _closing(self._stream("embedding", model_id,
                                         lambda llama, stats, emit: run_embeddings(llama, inputs, stats, emit),
                                         meter, "embd", "list", "input")) as stream:
            async for chunk in stream:
                yield chunk

    def _served(self, model_id: str) -> None:
        if model_id not in self.models:
            raise BackendError(404, f"model {model_id!r} is not served by this node", param="model")

    async def _stream(self, kind: PoolKind, model_id: str, work: Work, meter: UsageMeter | None,
                      id_prefix: str, object_name: str, param: str) -> AsyncIterator[dict[str, Any]]:
        """Run `work` on an instance of `model_id`'s `kind` pool (loading it first if it is not in
        memory) on a worker thread; yield what it emits, then the usage chunk. Closing this early
        stops the work within one token."""
        if self._executor is None:
            raise BackendError(503, "the llama.cpp backend is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def to_loop(callback: Callable[[Any], None], item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(callback, item)

        lease = await self._residency.lease(model_id, kind)  # held until the instance is handed back
        try:
            llama = await lease.pool.acquire()
        except BaseException:
            lease.release()
            raise
        stats = GenerationStats(model_id=model_id, instance=id(llama),
                                meter=meter if meter is not None else UsageMeter())
        executor = self._executor
        if executor is None:
            lease.pool.release(llama)
            lease.release()
            raise BackendError(503, "the llama.cpp backend is shut down")

        def handed_back(used: CountingLlama) -> None:  # on the loop, once the worker has stopped
            lease.pool.release(used)
            lease.release()
            stats.meter.end()

        self._active.add(stats)
        stats.meter.begin()
        try:
            executor.submit(self._work, llama, stats, work, param, lambda item: to_loop(queue.put_nowait, item),
                            lambda used: to_loop(handed_back, used))
        except RuntimeError:
            self._active.discard(stats)
            handed_back(llama)
            raise BackendError(503, "the llama.cpp backend is shut down") from None
        completion_id, created = new_completion_id(id_prefix), None
        try:
            while True:
                kind, item = await queue.get()
                if kind == "error":
                    raise item
                if kind == "done":
                    break
                created = item.get("created", created)
                item["id"], item["model"] = completion_id, model_id
                yield item
        finally:
            stats.cancel.set()  # no-op when the work already ended
            self._active.discard(stats)
        yield usage_chunk(completion_id, model_id, created, stats.prompt_tokens, stats.completion_tokens,
                          object_name=object_name)

    def _work(self, llama: CountingLlama, stats: GenerationStats, work: Work, param: str,
              emit: Callable[[tuple[str, Any]], None], release: Callable[[CountingLlama], None]) -> None:
        """Worker thread: run one request on a checked-out instance, then hand it back."""
        import jinja2

        terminal: tuple[str, Any] = ("done", None)
        llama.current = stats
        try:
            work(llama, stats, lambda chunk: emit(("chunk", chunk)) if not stats.cancel.is_set() else None)
            if stats.cancel.is_set():
                raise Cancelled()
        except Cancelled:
            stats.cancelled = True
        except BackendError as exc:
            terminal = ("error", exc)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            terminal = ("error", BackendError(400, _invalid_request_message(exc), param=param))
        except Exception as exc:  # a crash must still return the instance
            log.exception("llama.cpp request failed")
            terminal = ("error", BackendError(500, f"generation failed ({type(exc).__name__})"))
        finally:
            llama.current = None
            release(llama)  # queued before the terminal item, so the instance is free when the caller resumes
            emit(terminal)


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
