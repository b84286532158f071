"""The one interface every inference backend implements."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, runtime_checkable

from darkbloom.wire.protocol import Priority, Usage

# the priority of the request whose stream is being opened, set by the task serving it (a coordinator's
# batch line is "batch"); a backend that schedules work of its own (the llama.cpp engine) reads it
request_priority: contextvars.ContextVar[Priority] = contextvars.ContextVar("request_priority", default="live")

# What a node serves beyond plain chat (names from `wire.protocol.CAPABILITIES`).
TEXT_MODEL_CAPABILITIES = frozenset({"tools", "structured_output", "logprobs", "completions", "embeddings"})


class BackendError(Exception):
    """A request the backend rejected (4xx) or could not serve (5xx). A 400 names the request's
    `param` at fault; `code` is a machine-readable reason from `PROVIDER_ERROR_CODES`."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


class UsageMeter:
    """The token counts of one generation so far, for settling a request that was stopped early.

    The caller passes a fresh meter to `stream_chat`; the backend keeps the counts current as it
    goes (they always say what the final usage chunk would say if generation ended now), so after
    closing the stream early the caller reads the partial usage here. The counts are plain int
    stores and may be written from a worker thread.

    A backend whose generation outlives the stream's own task (llama.cpp runs on a worker thread that
    only notices the stop between tokens) calls `begin()` when that work starts and `end()` once it
    has really stopped, both on the event loop; `stopped()` waits for that, bounded. A backend that
    stops within `aclose()` (the upstream HTTP stream) never calls them.
    """

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt tokens, those read from a cache instead of evaluated
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self._idle.clear()

    def end(self) -> None:
        self._idle.set()

    async def stopped(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the generation to stop; False if it is still running."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Cancelled(Exception):
    """Raised where a request's own work notices that it was cancelled."""


@dataclass(eq=False)
class Generation:
    """One request's counts and cancel flag, shared by the event loop and an in-process engine's thread."""

    model_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False  # set when it has ended, if by a cancel
    background: bool = False  # a batch line: runs behind every live request (the engines' admission)
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    meter: UsageMeter = field(default_factory=UsageMeter, repr=False)

    def sync_meter(self) -> None:
        """Publish the counts so far to the request's meter (any thread)."""
        self.meter.prompt_tokens, self.meter.completion_tokens = self.prompt_tokens, self.completion_tokens
        self.meter.cached_tokens = self.cached_tokens

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled()


@runtime_checkable
class LoadsOnDemand(Protocol):
    """A backend whose models are not all in memory at once (llama.cpp: loaded on demand, unloaded
    when idle). Any other backend has every configured model ready (an upstream keeps its own)."""

    def loaded_models(self) -> list[str]:
        """The model ids in memory now."""
        ...

    def watch_loaded(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop after a model loads or unloads."""
        ...


@runtime_checkable
class RunsOnDevice(Protocol):
    """A backend that knows where it runs its models (llama.cpp: `cpu`, `metal`, `cuda`, …; `gpu_offload`).
    An upstream's device is unknown."""

    device: str


def device_of(backend: object) -> str | None:
    """Where `backend` runs its models, or None when it does not say."""
    return backend.device if isinstance(backend, RunsOnDevice) else None


class Backend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def stream_chat(self, model_id: str, body: dict[str, Any],
                    meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        """OpenAI `chat.completion.chunk` dicts, ending with one chunk whose `choices` is empty and
        whose `usage` holds the real token counts. Closing the iterator early stops generation; the
        optional `meter` then holds the tokens used so far (see `UsageMeter`).

        `BackendError.message` leaves the node unsealed (it is an `inference_error` frame), so it is
        always a sentence of our own: never prompt or completion text, never an upstream's or a
        library's free-text message (which can quote the prompt)."""
        ...

    def stream_completion(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        """Legacy `text_completion` chunks for a prompt, then the usage chunk (as `stream_chat`)."""
        ...

    def stream_embeddings(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        """One `{"object": "list", "data": [...]}` chunk of float embeddings, then the usage chunk
        (`completion_tokens` 0)."""
        ...

    def capabilities(self, model_id: str) -> frozenset[str]:
        """What `model_id` serves here beyond plain chat (`wire.protocol.CAPABILITIES` names)."""
        ...


def new_completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_chunk(completion_id: str, model_id: str, created: int | None,
                prompt_tokens: int, completion_tokens: int, *,
                object_name: str = "chat.completion.chunk", cached_tokens: int | None = None) -> dict[str, Any]:
    """The final chunk: OpenAI's `usage`, with `prompt_tokens_details.cached_tokens` when the backend
    knows how many prompt tokens it read from a cache."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return {
        "id": completion_id,
        "object": object_name,
        "created": int(time.time()) if created is None else created,
        "model": model_id,
        "choices": [],
        "usage": usage,
    }


def is_usage_chunk(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and isinstance(chunk.get("usage"), dict)


def chunk_usage(chunk: dict[str, Any]) -> Usage:
    """The token counts of a backend's final usage chunk (see `is_usage_chunk`); `cached_tokens` from
    its `prompt_tokens_details` (0 when absent), held within 0 and the prompt tokens."""
    usage = chunk["usage"]
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        cached = 0
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=int(usage.get("completion_tokens", 0)),
                 cached_tokens=min(max(cached, 0), prompt_tokens))
