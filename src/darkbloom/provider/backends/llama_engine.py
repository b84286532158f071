"""One loaded model serving many conversations: a llama.cpp context with a slot per sequence, driven
by one thread that advances every running sequence in one `llama_decode` per step.

The shape is llama-server's (slots over one context, continuous batching, prefix reuse) on
llama-cpp-python's low-level API. Requests arrive as `Sequence`s through `submit` (any thread); the
engine's thread owns the context, the batch and every slot:

- **Admission**: a waiting sequence takes the free slot whose cache it reuses best: the tokens its
  prompt shares with the slot's cache, less the cached tokens that would be dropped (so a
  conversation's next turn finds its own slot, and a new conversation takes an empty slot before it
  takes another conversation's; ties go to the least recently used). The rest of that slot's cache
  is dropped (`llama_memory_seq_rm`) and only the new tokens are evaluated; the reused count is the
  answer's `cached_tokens`. Every slot holds a full window (`n_ctx` cells of a KV cache split
  per sequence), so a prompt plus its `max_tokens`, bounded by the window before submission,
  always fits.
- **A step**: one batch with the next token of every generating sequence, then prompt tokens of the
  sequences still reading theirs, at most `prompt_step` in all (fewer on the CPU than on a GPU), so a
  long prompt arriving never freezes the streams already running. Each sequence that has a logits
  row after the step samples its next token with its own sampler chain (`llama_sampler`) and hands
  it to its `TextStream`.
- **Batch lines** (`Generation.background`: the coordinator's batch lines) run behind live
  requests: a live sequence waiting is admitted first, and while a live sequence is still reading its
  prompt, a step holds only live work (its prompt read at once, as on an idle engine; the batch lines'
  next tokens wait that one step), so a person's first token is not slowed by a batch.
- **Ends**: at end-of-generation, a stop, `max_tokens`, a cancel (seen at the next step), or an
  error in that sequence alone (a grammar with nowhere to go, a failing callback). A step llama.cpp
  refuses ends the sequences in it, and drops their slots' caches.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import llama_cpp
import numpy as np

from darkbloom.provider.backends.base import BackendError, Cancelled, Generation
from darkbloom.provider.backends.engine_loop import EngineLoop
from darkbloom.provider.backends.llama_decode import logits_logprob
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.llama_sampler import GrammarDeadEnd, SequenceSampler
from darkbloom.provider.backends.text_stream import Finish, Piece, TextStream

log = logging.getLogger(__name__)

BATCH = 512  # tokens per llama_decode (llama.cpp's n_batch and n_ubatch)
# Prompt tokens evaluated per step, over all sequences reading theirs. On the CPU a step's time grows
# with its tokens and running streams wait for the whole step (bench/RESULTS.md compares 128 with 512);
# a GPU takes 512 about as fast as a few.
PROMPT_STEP_CPU = 128
PROMPT_STEP_GPU = BATCH
FLASH_ATTENTION_NAME = "auto"  # llama.cpp's flash attention: "on", "off", or "auto" (its choice per device)
_FLASH_ATTENTION = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}


@dataclass(eq=False)
class Sequence:
    """What one request asks of the engine. `sink` gets the answer's pieces and its `Finish` (on the
    engine's thread); `finished` is called once, last, with None or the error that ended it."""

    prompt: list[int]
    sampler: SequenceSampler
    stream: TextStream
    sink: Callable[[Piece | Finish], None]
    generation: Generation
    top_logprobs: int | None = None
    grammar_param: str | None = None  # the request's parameter its grammar comes from
    finished: Callable[[BaseException | None], None] = lambda error: None
    cursor: int = 0  # prompt tokens in the slot's cache so far
    next_token: int | None = None  # sampled, not yet decoded


@dataclass(eq=False)
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # what this sequence id holds in the KV cache
    sequence: Sequence | None = None
    last_used: int = 0


# The engine's thread wants the GIL back the moment each llama_decode returns; with Python's default
# switch interval (5 ms) it can wait that long behind the event loop's thread at every step.
GIL_SWITCH_SECONDS = 0.001


class Engine(EngineLoop[Sequence]):
    backend_name = "llama.cpp"

    def __init__(self, model_id: str, path: Path, *, slots: int, n_ctx: int, n_threads: int, gpu_layers: int = 0,
                 extra_buffer_types: bool = False) -> None:
        """Raises ValueError when the model or its context cannot be made."""
        super().__init__(f"engine-{model_id}")
        self.model_id, self.n_ctx = model_id, n_ctx
        self.prompt_step = PROMPT_STEP_GPU if gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload() \
            else PROMPT_STEP_CPU
        self.model = LoadedModel(path, gpu_layers=gpu_layers, extra_buffer_types=extra_buffer_types)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * slots
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = slots
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = False  # a window per sequence: faster for unrelated conversations (llama.h)
        params.flash_attn_type = _FLASH_ATTENTION[FLASH_ATTENTION_NAME]
        params.no_perf = True
        self._ctx = self.model.new_context(params)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(BATCH, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(BATCH,))
        self._positions = np.ctypeslib.as_array(self._batch.pos, shape=(BATCH,))
        self._wants_logits = np.ctypeslib.as_array(self._batch.logits, shape=(BATCH,))
        for i in range(BATCH):
            self._batch.n_seq_id[i] = 1
        self.slots = [Slot(i) for i in range(slots)]
        self.steps = 0  # llama_decode calls so far
        self._uses = 0
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
        self._thread.start()

    def _free(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        self.model.close()

    # the engine's thread

    def _abandon_step(self) -> None:
        for slot in self.slots:
            llama_cpp.llama_memory_seq_rm(self._memory, slot.id, 0, -1)
            slot.tokens.clear()
            if slot.sequence is not None:
                self._release(slot, BackendError(500, "generation failed"))

    def _stop_running(self) -> None:
        for slot in self.slots:
            if slot.sequence is not None:
                self._release(slot, Cancelled())

    def _running(self) -> bool:
        return any(slot.sequence is not None for slot in self.slots)

    def _cancel_running(self) -> None:
        for slot in self.slots:
            if slot.sequence is not None and slot.sequence.generation.cancel.is_set():
                self._release(slot, Cancelled())

    def _admit(self) -> None:
        while self._waiting:
            free = [slot for slot in self.slots if slot.sequence is None]
            if not free:
                return
            sequence = self._next_waiting()
            prompt = sequence.prompt
            slot = max(free, key=lambda s: (_reuse(s.tokens, prompt), -s.last_used))
            keep = min(_common_prefix(slot.tokens, prompt), len(prompt) - 1)  # the last is read again: its logits
            if keep < len(slot.tokens) and not llama_cpp.llama_memory_seq_rm(self._memory, slot.id, keep, -1):
                llama_cpp.llama_memory_seq_rm(self._memory, slot.id, 0, -1)
                keep = 0
            del slot.tokens[keep:]
            sequence.cursor = keep
            generation = sequence.generation
            generation.prompt_tokens, generation.cached_tokens = len(prompt), keep
            generation.sync_meter()
            slot.sequence = sequence

    def _step(self) -> None:
        n = 0
        samples: list[tuple[Slot, int]] = []  # slots that sample after this step, with their logits row
        added: list[tuple[Slot, list[int]]] = []
        live_reading = any(s.sequence is not None and s.sequence.next_token is None
                           and not s.sequence.generation.background for s in self.slots)
        stepping = [slot for slot in self.slots if slot.sequence is not None
                    and not (live_reading and slot.sequence.generation.background)]
        for slot in stepping:
            sequence = slot.sequence
            if sequence is not None and sequence.next_token is not None:
                self._put(n, sequence.next_token, len(slot.tokens), slot.id, True)
                samples.append((slot, n))
                added.append((slot, [sequence.next_token]))
                n += 1
        budget = min(self.prompt_step, BATCH - n)
        for slot in stepping:
            sequence = slot.sequence
            if sequence is None or sequence.next_token is not None or budget <= 0:
                continue
            piece = sequence.prompt[sequence.cursor:sequence.cursor + budget]
            for i, token in enumerate(piece):
                self._put(n + i, token, len(slot.tokens) + i, slot.id, False)
            n += len(piece)
            budget -= len(piece)
            sequence.cursor += len(piece)
            added.append((slot, piece))
            if sequence.cursor == len(sequence.prompt):
                self._wants_logits[n - 1] = True
                samples.append((slot, n - 1))
        self._batch.n_tokens = n
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        self.steps += 1
        if status != 0:
            log.error("llama_decode failed (status %d) for a step of %d tokens", status, n)
            for slot, _ in added:
                llama_cpp.llama_memory_seq_rm(self._memory, slot.id, 0, -1)
                slot.tokens.clear()
                if slot.sequence is not None:
                    self._release(slot, BackendError(500, "generation failed (llama.cpp could not decode)"))
            return
        for slot, tokens in added:
            slot.tokens += tokens
        for slot, row in samples:
            self._advance(slot, llama_cpp.llama_get_logits_ith(self._ctx, row))

    def _put(self, index: int, token: int, position: int, seq_id: int, logits: bool) -> None:
        self._tokens[index], self._positions[index], self._wants_logits[index] = token, position, logits
        self._batch.seq_id[index][0] = seq_id

    def _advance(self, slot: Slot, logits: ctypes.c_void_p) -> None:
        """Sample `slot`'s next token and hand it on; end the sequence when its answer is over."""
        sequence = slot.sequence
        assert sequence is not None
        try:
            token = sequence.sampler.sample(logits)
            logprob = None if sequence.top_logprobs is None else \
                logits_logprob(self.model, logits, token, sequence.top_logprobs)
            done = self._hand_on(sequence, token, logprob)
        except GrammarDeadEnd:
            where = sequence.grammar_param
            self._release(slot, BackendError(400, f"no token can follow under {where} and logit_bias" if where
                                             else "logit_bias bans every token", param=where or "logit_bias"))
            return
        except BackendError as exc:
            self._release(slot, exc)
            return
        except Exception:  # a bug in one sequence's callbacks ends that sequence only
            log.exception("llama.cpp sequence failed")
            self._release(slot, BackendError(500, "generation failed"))
            return
        if done:
            self._release(slot, None)
        else:
            sequence.next_token = token

    def _release(self, slot: Slot, error: BaseException | None) -> None:
        sequence = slot.sequence
        assert sequence is not None
        slot.sequence = None
        self._uses += 1
        slot.last_used = self._uses
        self._end(sequence, error)

    def _end(self, sequence: Sequence, error: BaseException | None) -> None:
        sequence.sampler.close()
        super()._end(sequence, error)


def _reuse(cached: list[int], prompt: list[int]) -> int:
    """What putting `prompt` on a slot holding `cached` is worth: the tokens it reuses less those of the
    slot's cache it drops. A conversation's next turn scores its whole history; an empty slot 0; another
    conversation's slot less than 0 (it shares a system prompt at most), least for the longest."""
    common = _common_prefix(cached, prompt)
    return common - (len(cached) - common)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # the first difference, by bisection over list slices (C-speed comparisons)
    while low < high:
        middle = (low + high) // 2
        if a[:middle + 1] == b[:middle + 1]:
            low = middle + 1
        else:
            high = middle
    return low
