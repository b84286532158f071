"""In-process MLX (mlx-lm): MLX model directories, one engine per model (`mlx_engine`: batched
generation of `max_concurrency` sequences, prefix reuse), on Apple silicon's GPU or, off a Mac, MLX's
CPU build. How a request reaches its engine and streams back, and how its usage is counted:
`in_process`.

What it serves beyond plain chat: legacy completions and logprobs. Tools and structured output need
a grammar or a logits processor that makes the answer exact, which this backend does not have, and
it makes no embeddings: the coordinator's capability gate keeps those requests off MLX machines, and
direct mode answers them with a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

from darkbloom.provider.backends.base import BackendError, Generation
from darkbloom.provider.backends.chat_prompt import template_messages
from darkbloom.provider.backends.chunks import ChatChunks, completion_chunks
from darkbloom.provider.backends.in_process import InProcessBackend, Prepare
from darkbloom.provider.backends.mlx_engine import PREFILL_STEP_CPU, PREFILL_STEP_GPU, MlxEngine, MlxSequence
from darkbloom.provider.backends.mlx_sampling import check
from darkbloom.provider.backends.params import (chat_logprobs, check_token_ids, completion_job, require_object,
                                                sampling)
from darkbloom.provider.backends.text_stream import ContextOverflow, TextStream
from darkbloom.provider.backends.tool_params import ToolPlan
from darkbloom.provider.config import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_CONCURRENCY, ConfigError
from darkbloom.provider.memory_fit import EngineKind, MemoryBudget, MemoryNeed, estimate, memory_budget, refuse_unfit
from darkbloom.provider.mlx_model import NotAnMlxModel, read_config
from darkbloom.wire.openai.parameters import CHAT_SAMPLING_DEFAULTS

log = logging.getLogger(__name__)

MLX_CAPABILITIES = frozenset({"logprobs", "completions"})
METAL, CPU = "metal", "cpu"
_UNSERVED = {"tools": "tools", "functions": "functions", "response_format": "response_format"}


def mlx_device() -> str:
    """Where MLX runs here: Apple silicon's GPU (`metal`) or the CPU."""
    import mlx.core as mx

    return METAL if mx.default_device().type == mx.DeviceType.gpu else CPU


class MlxBackend(InProcessBackend[MlxEngine]):
    name = "MLX"

    def __init__(self, models: dict[str, Path], *, max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 n_ctx: int = 2048, memory: MemoryBudget | None = None,
                 keep_alive: float = DEFAULT_KEEP_ALIVE) -> None:
        """As `LlamaCppBackend`, over MLX model directories. Raises ConfigError for a directory that
        holds no MLX model, or a model that cannot fit."""
        needs: list[tuple[EngineKind, MemoryNeed]] = []
        for model_id, path in models.items():
            try:
                read_config(path)
            except NotAnMlxModel as exc:
                raise ConfigError(f"model {model_id!r}: {exc}") from None
            needs.append(("chat", estimate(model_id, path, n_ctx, max_concurrency)))
        memory = memory if memory is not None else memory_budget()
        refuse_unfit([need for _, need in needs], memory)
        self.device = mlx_device()
        super().__init__(models, max_concurrency=max_concurrency, n_ctx=n_ctx, needs=needs, memory=memory,
                         keep_alive=keep_alive)

    def _ready_line(self) -> str:
        return " on Apple silicon's GPU" if self.device == METAL else " on the CPU (MLX's CPU build)"

    def capabilities(self, model_id: str) -> frozenset[str]:
        return MLX_CAPABILITIES if model_id in self.models else frozenset()

    def engine(self, model_id: str) -> MlxEngine | None:
        """The model's engine if it is loaded now."""
        return self._residency.engine(model_id, "chat")

    async def _open_engine(self, model_id: str, kind: EngineKind) -> MlxEngine:
        path = self.models[model_id]
        prefill = PREFILL_STEP_GPU if self.device == METAL else PREFILL_STEP_CPU
        try:
            return await asyncio.to_thread(MlxEngine, model_id, path, slots=self.max_concurrency, n_ctx=self.n_ctx,
                                           prefill_step=prefill, cache_entries=2 * self.max_concurrency)
        except (ValueError, OSError) as exc:
            raise BackendError(500, f"cannot load model {model_id!r} from {path}: {exc}") from None

    def _chat(self, model_id: str, body: dict[str, Any]) -> Prepare[MlxEngine]:
        body = require_object(body)
        _refuse_unserved(body)
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) >= self.n_ctx:  # every message takes a token at least
            raise ContextOverflow(None, self.n_ctx, "messages")
        settings = sampling(body, CHAT_SAMPLING_DEFAULTS)
        settings.top_logprobs = chat_logprobs(body)
        checked = template_messages(messages)
        n_ctx = self.n_ctx

        def prepare(engine: MlxEngine, generation: Generation, emit: Callable[[dict[str, Any]], None]) -> MlxSequence:
            vocab = engine.vocab
            assert vocab is not None
            tokens = vocab.chat_prompt(checked, n_ctx)
            if len(tokens) >= n_ctx:
                raise ContextOverflow(len(tokens), n_ctx, "messages")
            out = ChatChunks(ToolPlan(), False, emit)
            stream = TextStream(vocab, settings, room=n_ctx - len(tokens))
            check(settings, vocab.n_vocab)
            sequence = MlxSequence(tokens, settings, stream, out.take, generation, settings.top_logprobs)
            out.send({"role": "assistant"})
            return sequence

        return prepare

    def _completion(self, model_id: str, body: dict[str, Any]) -> Prepare[MlxEngine]:
        job = completion_job(body, None)
        n_ctx = self.n_ctx

        def prepare(engine: MlxEngine, generation: Generation, emit: Callable[[dict[str, Any]], None]) -> MlxSequence:
            vocab = engine.vocab
            assert vocab is not None
            if isinstance(job.prompt, list):
                check_token_ids(job.prompt, vocab.n_vocab, "prompt")
                tokens, offset = job.prompt, len(vocab.detokenize(job.prompt).decode("utf-8", "replace"))
            else:
                tokens, offset = vocab.completion_prompt(job.prompt, n_ctx), len(job.prompt)
            if len(tokens) >= n_ctx:
                raise ContextOverflow(len(tokens), n_ctx, "prompt")
            stream = TextStream(vocab, job.sampling, room=n_ctx - len(tokens))
            check(job.sampling, vocab.n_vocab)
            return MlxSequence(tokens, job.sampling, stream, completion_chunks(job.sampling.top_logprobs, offset, emit),
                               generation, job.sampling.top_logprobs)

        return prepare


def _refuse_unserved(body: dict[str, Any]) -> None:
    """Tools and structured output: a 400 naming the parameter, never an answer that might not hold to it."""
    for name in _UNSERVED:
        value = body.get(name)
        if value is None or value == [] or (name == "response_format" and isinstance(value, dict)
                                            and value.get("type") == "text"):
            continue
        if name in ("tools", "functions") and body.get("tool_choice", body.get("function_call")) == "none":
            continue  # offered, not to be called: the answer is text
        raise BackendError(400, f"{name} is not served by this node's MLX backend (no grammar to hold the answer "
                                "to it)", param=name)
