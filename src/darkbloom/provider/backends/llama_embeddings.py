"""Embeddings on llama.cpp: the inputs of every waiting request decoded together, a sequence each.

One context with `embeddings` on and up to MAX_INPUTS sequences, driven by one thread: each step
takes inputs in arrival order (of one request or of several) while they fit in one batch of BATCH
tokens, decodes them at once, and hands each input's vector to its request. An input is at most
BATCH tokens (pooling needs all of it in one batch). Vectors are pooled the way the GGUF says (a
GGUF that says nothing, such as the bundled chat model, is mean-pooled) and scaled to length 1 as
OpenAI's are. A cancelled request's inputs still waiting are dropped.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llama_cpp
import numpy as np

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.base import Cancelled, Generation
from darkbloom.provider.backends.llama_model import LoadedModel

log = logging.getLogger(__name__)

BATCH = 512  # the most tokens one step (and so one input) may have
MAX_INPUTS = 16  # inputs decoded together at most


@dataclass(eq=False)
class EmbeddingRequest:
    """`on_vector(index, vector)` for each input in order, then `finished(None or the error)`, once."""

    inputs: list[list[int]]
    generation: Generation
    on_vector: Callable[[int, list[float]], None]
    finished: Callable[[BaseException | None], None]
    done: int = 0


class EmbeddingEngine:
    def __init__(self, model_id: str, path: Path, *, n_threads: int, own_pooling: bool, gpu_layers: int = 0,
                 extra_buffer_types: bool = False) -> None:
        """Raises ValueError when the model or its context cannot be made."""
        self.model_id = model_id
        self.model = LoadedModel(path, gpu_layers=gpu_layers, extra_buffer_types=extra_buffer_types)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = MAX_INPUTS
        params.kv_unified = True  # the step's inputs together fill at most one batch of cells
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if own_pooling else \
            llama_cpp.LLAMA_POOLING_TYPE_MEAN
        params.no_perf = True
        self._ctx = self.model.new_context(params)
        self._pooled = llama_cpp.llama_pooling_type(self._ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(BATCH, 0, 1)
        self.steps = 0
        self._queue: collections.deque[tuple[EmbeddingRequest, int]] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"embeddings-{model_id}", daemon=True)
        self._thread.start()

    def submit(self, request: EmbeddingRequest) -> None:
        """Queue `request`'s inputs (any thread); it ends at once, with a 503, when the engine is closing."""
        with self._wake:
            if not self._closing:
                self._queue.extend((request, index) for index in range(len(request.inputs)))
                self._wake.notify()
                return
        request.finished(BackendError(503, "the llama.cpp backend is shut down"))

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        self.model.close()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._closing or self._queue):
                    self._wake.wait()
                if self._closing:
                    break
                step = self._take()
            try:
                if step:
                    self._decode(step)
            except Exception:  # a bug of ours: this step's requests end, the engine goes on
                log.exception("llama.cpp embeddings step failed")
                for request in dict.fromkeys(r for r, _ in step):
                    self._fail(request, BackendError(500, "embedding failed"))
        ended = {request for request, _ in self._queue}
        for request in ended:
            request.finished(Cancelled())

    def _take(self) -> list[tuple[EmbeddingRequest, int]]:
        """The inputs of the next step (the queue's lock held); a cancelled request's are dropped."""
        step: list[tuple[EmbeddingRequest, int]] = []
        size = 0
        while self._queue and len(step) < MAX_INPUTS:
            request, index = self._queue[0]
            if request.generation.cancel.is_set():
                self._queue.popleft()
                if index == len(request.inputs) - 1:
                    request.finished(Cancelled())
                continue
            tokens = len(request.inputs[index])
            if step and size + tokens > BATCH:
                break
            self._queue.popleft()
            step.append((request, index))
            size += tokens
        return step

    def _decode(self, step: list[tuple[EmbeddingRequest, int]]) -> None:
        batch, n = self._batch, 0
        for seq_id, (request, index) in enumerate(step):
            for position, token in enumerate(request.inputs[index]):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, position, 1, True
                batch.seq_id[n][0] = seq_id
                n += 1
        batch.n_tokens = n
        status = llama_cpp.llama_decode(self._ctx, batch)
        self.steps += 1
        try:
            if status != 0:
                log.error("llama_decode failed (status %d) for %d embeddings inputs", status, len(step))
                for request in dict.fromkeys(r for r, _ in step):
                    self._fail(request, BackendError(500, "embedding failed (llama.cpp could not decode)"))
                return
            row = 0
            for seq_id, (request, index) in enumerate(step):
                size = len(request.inputs[index])
                vector = self._vector(seq_id, row, size)
                row += size
                if request.done < 0:  # failed already
                    continue
                request.generation.prompt_tokens += size
                request.generation.sync_meter()
                request.on_vector(index, vector)
                request.done += 1
                if request.done == len(request.inputs):
                    request.finished(None)
        finally:
            llama_cpp.llama_memory_clear(self._memory, True)

    def _vector(self, seq_id: int, first_row: int, size: int) -> list[float]:
        n_embd = self.model.n_embd()
        if self._pooled:
            pointer = ctypes.cast(llama_cpp.llama_get_embeddings_seq(self._ctx, seq_id), ctypes.POINTER(ctypes.c_float))
            vector = np.ctypeslib.as_array(pointer, shape=(n_embd,)).astype(np.float64)
        else:
            pointer = ctypes.cast(llama_cpp.llama_get_embeddings(self._ctx), ctypes.POINTER(ctypes.c_float))
            rows = np.ctypeslib.as_array(pointer, shape=(first_row + size, n_embd))[first_row:]
            vector = rows.astype(np.float64).mean(axis=0)
        norm = math.sqrt(float(np.dot(vector, vector)))
        return [float(v) for v in (vector / norm if norm > 0 else vector)]

    def _fail(self, request: EmbeddingRequest, error: BaseException) -> None:
        if 0 <= request.done < len(request.inputs):  # not ended yet
            request.done = -1
            request.finished(error)
            with self._wake:  # its other inputs are not decoded
                self._queue = collections.deque(item for item in self._queue if item[0] is not request)
