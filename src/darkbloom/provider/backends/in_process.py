"""What the in-process backends (llama.cpp, MLX) share: a model's engines loaded on demand and
unloaded when idle (`residency`), a request checked on the event loop, rendered and tokenized on a
worker thread that hands its engine the work, and the engine's chunks streamed back to the event
loop through an asyncio queue, ending with the usage chunk.

Usage counting: prompt tokens are the templated prompt's tokens, `cached_tokens` those of them the
engine found in a cache, completion tokens every sampled token except an end-of-generation one.
The counts are kept current in the request's `UsageMeter` as they change, so a request stopped
early reports the tokens really used; the meter's `end()` comes once the engine has let go of it
(a cancel is seen at the engine's next step).

Error messages are our own sentences: a library or chat-template exception can quote the prompt,
and `BackendError.message` leaves the node unsealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generic, Iterable, Protocol, TypeVar

from darkbloom.provider.backends.base import (BackendError, Cancelled, Generation, UsageMeter, new_completion_id,
                                              request_priority, usage_chunk)
from darkbloom.provider.backends.residency import SHUT_DOWN, Residency
from darkbloom.provider.memory_fit import EngineKind, MemoryBudget, MemoryNeed

log = logging.getLogger(__name__)


class Engine(Protocol):
    def submit(self, work: Any) -> None: ...

    def close(self) -> None: ...


E = TypeVar("E", bound=Engine)
# a request as its engine's work: anything with a `finished(error)` the engine calls once, last
Prepare = Callable[[E, Generation, Callable[[dict[str, Any]], None]], Any]


class InProcessBackend(Generic[E]):
    """`models`: id → weights (a GGUF file, an MLX directory); `needs`: the memory each engine needs."""

    name = "in-process"  # for log lines

    def __init__(self, models: dict[str, Path], *, max_concurrency: int, n_ctx: int,
                 needs: Iterable[tuple[EngineKind, MemoryNeed]], memory: MemoryBudget, keep_alive: float) -> None:
        self.models = dict(models)
        self.max_concurrency = max_concurrency
        self.n_ctx = n_ctx
        self.memory = memory
        self._residency: Residency[E] = Residency(needs, self._open_engine, memory, keep_alive)
        self._active: set[Generation] = set()
        self._executor: ThreadPoolExecutor | None = None

    async def _open_engine(self, model_id: str, kind: EngineKind) -> E:
        """A new engine, its model loaded (a bad file fails here: BackendError)."""
        raise NotImplementedError

    def _ready_line(self) -> str:
        """How the log's "ready" line describes the backend (device, threads…)."""
        return ""

    async def start(self) -> None:
        """Load the models that fit, in config order (a bad file among them fails here)."""
        self._executor = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="prompt")
        for model_id in self.models:
            await self._residency.preload(model_id)
        on_demand = [model_id for model_id in self.models if model_id not in self.loaded_models()]
        log.info("%s backend ready%s: %s loaded%s (%d sequences per model; memory %s)", self.name,
                 self._ready_line(), ", ".join(self.loaded_models()) or "no model",
                 f", {', '.join(on_demand)} on demand" if on_demand else "", self.max_concurrency,
                 self._residency.used_text())

    async def close(self) -> None:
        for generation in list(self._active):
            generation.cancel.set()
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None
        await self._residency.close()

    def loaded_models(self) -> list[str]:
        """The model ids in memory now (a request for another one waits for its load)."""
        return self._residency.loaded_models()

    def watch_loaded(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop after a model loads or unloads."""
        self._residency.watch(callback)

    def _served(self, model_id: str) -> None:
        if model_id not in self.models:
            raise BackendError(404, f"model {model_id!r} is not served by this node", param="model")

    # each API: the request checked here (event loop), then `prepare`d as its engine's work

    def _chat(self, model_id: str, body: dict[str, Any]) -> Prepare[E]:
        raise NotImplementedError

    def _completion(self, model_id: str, body: dict[str, Any]) -> Prepare[E]:
        raise NotImplementedError

    def _embeddings(self, model_id: str, body: dict[str, Any]) -> Prepare[E]:
        raise BackendError(400, f"model {model_id!r} is served by {self.name} here, which makes no embeddings",
                           param="model")

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        prepare = self._chat(model_id, body)
        async with closing(self._stream("chat", model_id, prepare, meter, "chatcmpl", "chat.completion.chunk",
                                        "messages")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_completion(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        prepare = self._completion(model_id, body)
        async with closing(self._stream("chat", model_id, prepare, meter, "cmpl", "text_completion",
                                        "prompt")) as stream:
            async for chunk in stream:
                yield chunk

    async def stream_embeddings(self, model_id: str, body: dict[str, Any],
                                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self._served(model_id)
        prepare = self._embeddings(model_id, body)
        async with closing(self._stream("embedding", model_id, prepare, meter, "embd", "list", "input")) as stream:
            async for chunk in stream:
                yield chunk

    async def _stream(self, kind: EngineKind, model_id: str, prepare: Prepare[E], meter: UsageMeter | None,
                      id_prefix: str, object_name: str, param: str) -> AsyncIterator[dict[str, Any]]:
        """Prepare the request on a worker thread against `model_id`'s `kind` engine (loading it first if
        it is not in memory) and hand it to the engine; yield what it emits, then the usage chunk.
        Closing this early stops the work at the engine's next step."""
        if self._executor is None:
            raise BackendError(503, SHUT_DOWN)
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
            raise BackendError(503, SHUT_DOWN)
        self._active.add(generation)
        generation.meter.begin()
        try:
            executor.submit(self._prepare, lease.engine, prepare, generation, emit, param,
                            lambda error: to_loop(handed_back, error))
        except RuntimeError:
            self._active.discard(generation)
            handed_back(None)
            raise BackendError(503, SHUT_DOWN) from None
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

    def _prepare(self, engine: E, prepare: Prepare[E], generation: Generation,
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
            log.exception("preparing a request failed")
            finished(BackendError(500, f"generation failed ({type(exc).__name__})"))
        else:
            work.finished = finished
            engine.submit(work)

    def _ended(self, generation: Generation) -> None:
        """On the event loop, once the engine has let go of `generation` (tests record it here)."""


def closing(stream: AsyncIterator[dict[str, Any]]) -> contextlib.AbstractAsyncContextManager[Any]:
    """Close the inner stream as soon as the outer one is closed (stops its work within one token)."""
    return contextlib.aclosing(stream)  # type: ignore[type-var,unused-ignore]


_CONTEXT_OVERFLOW = re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)")


def _invalid_request_message(exc: Exception) -> str:
    """Our own sentence for a request the model's library rejected; never the exception's text (it can
    quote the prompt: a chat template's error, a tokenizer's complaint). Only numbers are taken from it."""
    import jinja2

    if overflow := _CONTEXT_OVERFLOW.search(str(exc)):
        return f"the prompt is {overflow[1]} tokens, too long for this model's context window of {overflow[2]}"
    if "context window" in str(exc):
        return "the request does not fit in this model's context window"
    if isinstance(exc, jinja2.TemplateError):
        return "this model's chat template rejected the messages (check the roles and their order)"
    return "the request is not valid for this model"
