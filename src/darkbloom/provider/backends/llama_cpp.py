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

Error messages are our own sentences: a library or chat-template exception can quote the prompt,
and `BackendError.message` leaves the node unsealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import llama_cpp

from darkbloom.provider.backends.base import BackendError, UsageMeter, new_completion_id, usage_chunk
from darkbloom.provider.backends.params import chat_kwargs

log = logging.getLogger(__name__)


def _disable_extra_buffer_types() -> None:
    """llama.cpp's "extra buffer types" repack weights for special kernels (AMX among them). Some
    VMs advertise AMX in cpuinfo without enabling it, and the AMX matmul then kills the process with
    SIGSEGV on the first decode. `Llama()` has no switch for `use_extra_bufts`, so default it off for
    this process (plain CPU kernels; DARKBLOOM_LLAMA_EXTRA_BUFTS=1 keeps the library default)."""
    raw = llama_cpp.llama_cpp
    if os.environ.get("DARKBLOOM_LLAMA_EXTRA_BUFTS") == "1" or getattr(raw.llama_model_default_params,
                                                                       "_darkbloom", False):
        return
    original = raw.llama_model_default_params

    def model_default_params() -> Any:
        params = original()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    model_default_params._darkbloom = True  # type: ignore[attr-defined]
    raw.llama_model_default_params = model_default_params


_disable_extra_buffer_types()


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class GenerationStats:
    """One finished (or cancelled) generation, kept in `LlamaCppBackend.recent` for tests and metrics."""

    model_id: str
    instance: int
    prompt_tokens: int = 0
    sampled: int = 0
    last_was_eog: bool = False
    cancelled: bool = False
    error: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    meter: UsageMeter = field(default_factory=UsageMeter, repr=False)

    @property
    def completion_tokens(self) -> int:
        return self.sampled - (1 if self.last_was_eog else 0)

    def sync_meter(self) -> None:
        """Worker thread: publish the counts so far to the request's meter."""
        self.meter.prompt_tokens, self.meter.completion_tokens = self.prompt_tokens, self.completion_tokens


class _CountingLlama(llama_cpp.Llama):
    current: GenerationStats | None = None

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:  # type: ignore[override]
        stats = self.current
        if stats is None:
            yield from super().generate(tokens, *args, **kwargs)
            return
        stats.prompt_tokens = len(tokens)
        stats.sync_meter()
        for token in super().generate(tokens, *args, **kwargs):
            if stats.cancel.is_set():
                raise _Cancelled()
            stats.sampled += 1
            # The library's own end-of-generation test (it stops without counting this token).
            stats.last_was_eog = bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))
            stats.sync_meter()
            yield token


class _Pool:
    """Up to `size` instances of one model; `acquire` hands one out exclusively."""

    def __init__(self, model_id: str, path: Path, size: int, load: Callable[[Path], _CountingLlama]) -> None:
        self.model_id, self.path, self.size = model_id, path, size
        self._load = load
        self._idle: asyncio.Queue[_CountingLlama] = asyncio.Queue()
        self._created = 0
        self.instances: list[_CountingLlama] = []

    async def acquire(self) -> _CountingLlama:
        if self._idle.empty() and self._created < self.size:
            self._created += 1
            try:
                llama = await asyncio.to_thread(self._load_checked)
            except BaseException:
                self._created -= 1
                raise
            self.instances.append(llama)
            return llama
        return await self._idle.get()

    def release(self, llama: _CountingLlama) -> None:
        self._idle.put_nowait(llama)

    def _load_checked(self) -> _CountingLlama:
        try:
            return self._load(self.path)
        except (ValueError, RuntimeError, OSError) as exc:
            raise BackendError(500, f"cannot load model {self.model_id!r} from {self.path}: {exc}") from None

    def close(self) -> None:
        for llama in self.instances:
            llama.close()
        self.instances.clear()


class LlamaCppBackend:
    def __init__(self, models: dict[str, Path], *, max_concurrency: int = 2, n_ctx: int = 2048,
                 n_threads: int = 0) -> None:
        self.models = dict(models)
        self.max_concurrency = max_concurrency
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, (os.cpu_count() or 1) // max_concurrency)
        self.recent: deque[GenerationStats] = deque(maxlen=64)
        self._pools: dict[str, _Pool] = {}
        self._active: set[GenerationStats] = set()
        self._executor: ThreadPoolExecutor | None = None

    def _load(self, path: Path) -> _CountingLlama:
        return _CountingLlama(model_path=str(path), n_ctx=self.n_ctx, n_threads=self.n_threads,
                              n_threads_batch=self.n_threads, verbose=False)

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="llama")
        for model_id, path in self.models.items():
            pool = _Pool(model_id, path, self.max_concurrency, self._load)
            self._pools[model_id] = pool
            pool.release(await pool.acquire())  # load one instance now: a bad file fails at start
        log.info("llama.cpp backend ready: %s (pool of %d per model, %d threads each)",
                 ", ".join(self.models), self.max_concurrency, self.n_threads)

    async def close(self) -> None:
        for stats in list(self._active):
            stats.cancel.set()
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        pool = self._pools.get(model_id)
        if pool is None:
            raise BackendError(404, f"model {model_id!r} is not served by this node")
        kwargs = chat_kwargs(body)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def to_loop(callback: Callable[[Any], None], item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(callback, item)

        llama = await pool.acquire()
        stats = GenerationStats(model_id=model_id, instance=id(llama),
                                meter=meter if meter is not None else UsageMeter())
        executor = self._executor
        if executor is None:
            pool.release(llama)
            raise BackendError(503, "the llama.cpp backend is shut down")

        def handed_back(used: _CountingLlama) -> None:  # on the loop, once the worker has stopped
            pool.release(used)
            stats.meter.end()

        self._active.add(stats)
        stats.meter.begin()
        try:
            executor.submit(self._generate, llama, stats, kwargs,
                            lambda item: to_loop(queue.put_nowait, item), lambda used: to_loop(handed_back, used))
        except RuntimeError:
            self._active.discard(stats)
            handed_back(llama)
            raise BackendError(503, "the llama.cpp backend is shut down") from None
        completion_id, created = new_completion_id(), None
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
            stats.cancel.set()  # no-op when the generation already ended
            self._active.discard(stats)
        yield usage_chunk(completion_id, model_id, created, stats.prompt_tokens, stats.completion_tokens)

    def _generate(self, llama: _CountingLlama, stats: GenerationStats, kwargs: dict[str, Any],
                  emit: Callable[[tuple[str, Any]], None], release: Callable[[_CountingLlama], None]) -> None:
        """Worker thread: run one generation on a checked-out instance, then hand it back."""
        import jinja2

        terminal: tuple[str, Any] = ("done", None)
        stream: Any = None
        llama.current = stats
        try:
            stream = llama.create_chat_completion(stream=True, **kwargs)
            for chunk in stream:
                if stats.cancel.is_set():
                    raise _Cancelled()
                emit(("chunk", chunk))
        except _Cancelled:
            stats.cancelled = True
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            stats.error = str(exc)  # kept in memory only (`recent`): it may quote the prompt
            terminal = ("error", BackendError(400, _invalid_request_message(exc)))
        except Exception as exc:  # a crash in generation must still return the instance
            log.exception("llama.cpp generation failed")
            stats.error = repr(exc)
            terminal = ("error", BackendError(500, f"generation failed ({type(exc).__name__})"))
        finally:
            if stream is not None:
                stream.close()
            llama.current = None
            self.recent.append(stats)
            release(llama)  # queued before the terminal item, so the instance is free when the caller resumes
            emit(terminal)


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
