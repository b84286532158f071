"""One loaded MLX model serving many conversations: mlx-lm's `BatchGenerator` (continuous batching:
every running sequence advances in one forward pass per step, prompts read in chunks beside them)
and its `LRUPromptCache` (prefix reuse), driven by one thread that owns the model, the generator and
the cache. MLX arrays and streams belong to the thread that made them: the model is loaded there too.

- **Admission**: at most `slots` sequences run at once; a live request waiting is admitted before a
  coordinator's batch line. A prompt starts from the cached KV state of the longest prefix it shares
  with an earlier conversation (the whole of it when it is one's next turn); that prefix is the
  answer's `cached_tokens`, and only the rest is read.
- **A step**: one `BatchGenerator.next()` — the next token of every generating sequence, and up to
  `prefill_step` prompt tokens of each sequence still reading its prompt. Each sampled token goes
  to its sequence's `TextStream` (stop strings, UTF-8, `max_tokens`).
- **Ends**: end-of-generation, a stop string, `max_tokens`, a cancel (seen at the next step), or an
  error in that sequence's own callback. The sequence's KV state (prompt and answer) goes back to
  the prompt cache for the conversation's next turn. A step MLX refuses ends every sequence in it
  and starts a fresh generator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from darkbloom.provider.backends.base import BackendError, Cancelled, Generation
from darkbloom.provider.backends.engine_loop import EngineLoop
from darkbloom.provider.backends.mlx_prompt import MlxVocabulary
from darkbloom.provider.backends.mlx_sampling import logits_processors, sampler
from darkbloom.provider.backends.params import Sampling
from darkbloom.provider.backends.text_stream import Finish, Piece, TextStream, TokenLogprob, token_logprob

log = logging.getLogger(__name__)

PREFILL_STEP_CPU = 128  # prompt tokens per sequence per step (as llama.cpp's engine): running streams wait for it
PREFILL_STEP_GPU = 2048  # mlx-lm's own


@dataclass(eq=False)
class MlxSequence:
    """What one request asks of the engine. `sink` gets the answer's pieces and its `Finish` (on the
    engine's thread); `finished` is called once, last, with None or the error that ended it."""

    prompt: list[int]
    sampling: Sampling  # checked (`mlx_sampling.check`); its sampler and processors are made on admission
    stream: TextStream
    sink: Callable[[Piece | Finish], None]
    generation: Generation
    top_logprobs: int | None = None
    finished: Callable[[BaseException | None], None] = lambda error: None
    uid: int | None = field(default=None, repr=False)


class MlxEngine(EngineLoop[MlxSequence]):
    backend_name = "MLX"

    def __init__(self, model_id: str, path: Path, *, slots: int, n_ctx: int, prefill_step: int,
                 cache_entries: int) -> None:
        """Loads the model on the engine's own thread; raises ValueError when it cannot be loaded."""
        super().__init__(f"mlx-{model_id}")
        self.model_id, self.path, self.n_ctx, self.slots = model_id, path, n_ctx, slots
        self.prefill_step, self.cache_entries = prefill_step, cache_entries
        self.steps = 0  # BatchGenerator steps so far
        self.vocab: MlxVocabulary | None = None
        self._running_uids: dict[int, MlxSequence] = {}
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise ValueError(f"{type(self._load_error).__name__}: {self._load_error}")

    # the engine's thread

    def _open(self) -> bool:
        try:
            self._load()
        except Exception as exc:  # a directory mlx-lm cannot load: the caller says which
            self._load_error = exc
            return False
        finally:
            self._loaded.set()
        return True

    def _load(self) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import LRUPromptCache
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.utils import load_model

        self._mx = mx
        self._stream = mx.default_stream(mx.default_device())
        self._model, config = load_model(self.path)
        eos = config.get("eos_token_id")
        self.vocab = MlxVocabulary(load_tokenizer(self.path, eos_token_ids=[eos] if isinstance(eos, int) else eos))
        self._cache = LRUPromptCache(max_size=self.cache_entries)
        self._generator = self._new_generator()

    def _new_generator(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        assert self.vocab is not None
        return BatchGenerator(self._model, stop_tokens=[[token] for token in sorted(self.vocab.eog)],
                              completion_batch_size=self.slots, prefill_batch_size=self.slots,
                              prefill_step_size=self.prefill_step, stream=self._stream)

    def _running(self) -> bool:
        return bool(self._running_uids)

    def _cancel_running(self) -> None:
        for uid, sequence in list(self._running_uids.items()):
            if sequence.generation.cancel.is_set():
                self._release(uid, Cancelled())

    def _abandon_step(self) -> None:
        """The generator is not asked for anything more (it may be what failed): a fresh one replaces it."""
        running, self._running_uids = self._running_uids, {}
        with contextlib.suppress(Exception):
            self._generator.close()
        self._generator = self._new_generator()
        for sequence in running.values():
            self._end(sequence, BackendError(500, "generation failed"))

    def _stop_running(self) -> None:
        for uid in list(self._running_uids):
            self._release(uid, Cancelled(), keep_cache=False)

    def _closed(self) -> None:
        self._generator.close()
        del self._generator, self._model, self._cache
        self._mx.clear_cache()

    def _admit(self) -> None:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        while self._waiting and len(self._running_uids) < self.slots:
            sequence = self._next_waiting()
            prompt = sequence.prompt
            cache, rest = self._cache.fetch_nearest_cache(self.model_id, prompt)
            if cache is not None and not rest:  # the whole prompt is cached: its last token is read again (logits)
                if can_trim_prompt_cache(cache):
                    trim_prompt_cache(cache, 1)
                    rest = prompt[-1:]
                else:
                    cache, rest = None, prompt
            cached = len(prompt) - len(rest)
            (uid,) = self._generator.insert([rest], max_tokens=[sequence.stream.max_tokens + 1], caches=[cache],
                                            all_tokens=[prompt[:cached]], samplers=[sampler(sequence.sampling)],
                                            logits_processors=[logits_processors(sequence.sampling)])
            sequence.uid = uid
            generation = sequence.generation
            generation.prompt_tokens, generation.cached_tokens = len(prompt), cached
            generation.sync_meter()
            self._running_uids[uid] = sequence

    def _step(self) -> None:
        _, responses = self._generator.next()
        self.steps += 1
        for response in responses:
            sequence = self._running_uids.get(response.uid)
            if sequence is None:
                continue
            try:
                done = self._advance(sequence, response)
            except Exception:  # a bug in one sequence's callbacks ends that sequence only
                log.exception("MLX sequence failed")
                self._release(response.uid, BackendError(500, "generation failed"), keep_cache=False)
                continue
            if done and response.finish_reason is None:
                self._release(response.uid, None)
            elif response.finish_reason is not None:  # the generator let go of it, handing back its KV state
                self._running_uids.pop(response.uid)
                self._keep_cache(response.all_tokens, response.prompt_cache)
                # the stream ends first (the generator's max_tokens is one more; its stop tokens are the stream's)
                self._end(sequence, None if done else BackendError(500, "generation ended early"))

    def _advance(self, sequence: MlxSequence, response: Any) -> bool:
        """Hand the sampled token on; whether the sequence's answer is over."""
        token = int(response.token)
        logprob = None if sequence.top_logprobs is None else \
            self._logprob(response.logprobs, token, sequence.top_logprobs)
        return self._hand_on(sequence, token, logprob)

    def _logprob(self, logprobs: Any, token: int, top_n: int) -> TokenLogprob:
        """From the row the token was sampled from (after logit bias and penalties, before temperature and
        the filters)."""
        assert self.vocab is not None
        return token_logprob(self.vocab, np.array(logprobs.astype(self._mx.float32)), token, top_n)

    def _release(self, uid: int, error: BaseException | None, *, keep_cache: bool = True) -> None:
        """Take a running sequence out of the generator (if it still holds it), keeping its KV state for a
        next turn."""
        sequence = self._running_uids.pop(uid)
        caches = self._generator.remove([uid], return_prompt_caches=keep_cache)
        if keep_cache and uid in caches:
            cache, tokens = caches[uid]
            self._keep_cache(tokens, cache)
        self._end(sequence, error)

    def _keep_cache(self, tokens: list[int] | None, cache: Any) -> None:
        if tokens and cache is not None:
            self._cache.insert_cache(self.model_id, list(tokens), cache)
