"""llama.cpp instances for the backend: the counting `Llama` subclass, and a pool per model and kind.

`CountingLlama.generate` wraps the library's token loop (see `llama_cpp`'s docstring for the usage
rules); a pool hands instances out exclusively, creating them lazily up to its size.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import llama_cpp
from llama_cpp import _internals as llama_internals

from darkbloom.provider.backends.base import BackendError, UsageMeter


EVAL_PIECE = 128  # prompt tokens evaluated between two looks at the cancel flag


class Cancelled(Exception):
    """Raised in the worker thread at the next token once a request is cancelled."""


@dataclass(eq=False)
class GenerationStats:
    """One generation's counts and cancel flag, shared by the event loop and the worker thread running it."""

    model_id: str
    instance: int
    prompt_tokens: int = 0
    sampled: int = 0
    last_was_eog: bool = False
    cancelled: bool = False
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    meter: UsageMeter = field(default_factory=UsageMeter, repr=False)

    @property
    def completion_tokens(self) -> int:
        return self.sampled - (1 if self.last_was_eog else 0)

    def sync_meter(self) -> None:
        """Worker thread: publish the counts so far to the request's meter."""
        self.meter.prompt_tokens, self.meter.completion_tokens = self.prompt_tokens, self.completion_tokens


class CountingLlama(llama_cpp.Llama):
    """A `Llama` that counts, cancels and biases the generation it runs (`current`).

    `extra_buffer_types` is llama.cpp's `use_extra_bufts`: weights repacked for special kernels (AMX
    among them). Some VMs advertise AMX in cpuinfo without enabling it, and the AMX matmul then kills
    the process with SIGSEGV on the first decode, so the node's default is off (plain CPU kernels)."""

    current: GenerationStats | None = None
    logit_bias: dict[int, float] = {}  # of the generation running now (set by `llama_decode.decode`)

    def __init__(self, *args: Any, extra_buffer_types: bool = False, **kwargs: Any) -> None:
        self._extra_buffer_types = extra_buffer_types
        super().__init__(*args, **kwargs)

    @property
    def model_params(self) -> Any:
        return self._model_params

    @model_params.setter
    def model_params(self, params: Any) -> None:
        """`Llama.__init__` sets the library's defaults here before loading; it has no switch for
        `use_extra_bufts`, so this is where ours goes in."""
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = self._extra_buffer_types
        self._model_params = params

    def _init_sampler(self, *args: Any, **kwargs: Any) -> Any:
        """The library's sampler chain, behind llama.cpp's own logit-bias sampler when one is asked for."""
        chain = super()._init_sampler(*args, **kwargs)
        if not self.logit_bias:
            return chain
        outer = llama_internals.LlamaSampler()
        outer.add_logit_bias(self._n_vocab, self.logit_bias)
        llama_cpp.llama_sampler_chain_add(outer.sampler, chain.sampler)
        chain.sampler = None  # owned (and freed) by the outer chain now
        return outer

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:  # type: ignore[override]
        stats = self.current
        if stats is None:
            yield from super().generate(tokens, *args, **kwargs)
            return
        stats.prompt_tokens = len(tokens)
        stats.sync_meter()
        for token in super().generate(tokens, *args, **kwargs):
            if stats.cancel.is_set():
                raise Cancelled()
            stats.sampled += 1
            # The library's own end-of-generation test (it stops without counting this token).
            stats.last_was_eog = bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))
            stats.sync_meter()
            yield token

    def eval(self, tokens: Any) -> None:
        """The library's prefill, EVAL_PIECE tokens at a time with the cancel flag checked before each:
        a cancelled request (or a node stopping) never waits for a whole prompt to be evaluated."""
        stats = self.current
        if not tokens:
            super().eval(tokens)
        step = min(self.n_batch, EVAL_PIECE)
        for start in range(0, len(tokens), step):
            if stats is not None and stats.cancel.is_set():
                raise Cancelled()
            super().eval(tokens[start:start + step])


class Pool:
    """Up to `size` instances of one model; `acquire` hands one out exclusively."""

    def __init__(self, model_id: str, path: Path, size: int, load: Callable[[Path], CountingLlama],
                 load_hint: str = "") -> None:
        """`load_hint`: appended to the message of a load that fails (what to try then)."""
        self.model_id, self.path, self.size = model_id, path, size
        self._load = load
        self._load_hint = load_hint
        self._idle: asyncio.Queue[CountingLlama] = asyncio.Queue()
        self._created = 0
        self.instances: list[CountingLlama] = []

    async def acquire(self) -> CountingLlama:
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

    def release(self, llama: CountingLlama) -> None:
        self._idle.put_nowait(llama)

    def _load_checked(self) -> CountingLlama:
        try:
            return self._load(self.path)
        except (ValueError, RuntimeError, OSError) as exc:
            message = f"cannot load model {self.model_id!r} from {self.path}: {exc}{self._load_hint}"
            raise BackendError(500, message) from None

    def close(self) -> None:
        for llama in self.instances:
            llama.close()
        self.instances.clear()
