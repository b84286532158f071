"""Legacy prompt completions and embeddings on llama.cpp (checked on the event loop, run on a worker).

Completions: the raw prompt, no chat template, tokenized as text (BOS when the model asks for one;
unlike `create_completion`, text such as `<|im_start|>` never becomes a control token: OpenAI's API
takes a prompt as text) and bounded as every prompt is (`llama_prompt`); token-id prompts are used as
they are. `echo` and `suffix` are refused (400 naming them). `logprobs` (0–5) in the legacy shape:
`tokens`, `token_logprobs`, `top_logprobs` ({token: logprob}), `text_offset` (from the start of the
prompt).

Embeddings: an instance loaded with `embedding=True`. Each input is decoded on its own, as one batch
(so an input may have up to the instance's batch size of tokens), pooled the way the GGUF says (the
backend loads a GGUF that says nothing, such as the bundled chat model, with mean pooling), and
scaled to length 1 as OpenAI's are. Each vector goes as soon as it is made, in a chunk of its own:
`{"object": "list", "data": [one embedding object with its "index"]}` (the shape of the whole
answer with part of its data), so no answer is ever one frame too large for the socket.
Usage: every token embedded is a prompt token.
"""

from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import llama_cpp
import numpy as np

from darkbloom.provider.backends.llama_decode import ContextOverflow, Piece, decode
from darkbloom.provider.backends.llama_instances import Cancelled, CountingLlama, GenerationStats
from darkbloom.provider.backends.llama_prompt import bounded_tokens
from darkbloom.provider.backends.params import (Sampling, check_token_ids, completion_options, completion_prompt,
                                                embedding_inputs, require_object, sampling)
from darkbloom.wire.openai.parameters import COMPLETION_SAMPLING_DEFAULTS


@dataclass
class CompletionJob:
    prompt: str | list[int]
    sampling: Sampling


def completion_job(body: Any, n_vocab: int | None) -> CompletionJob:
    body = require_object(body)
    prompt = completion_prompt(body)
    settings = sampling(body, COMPLETION_SAMPLING_DEFAULTS, n_vocab)
    settings.top_logprobs = completion_options(body)
    return CompletionJob(prompt, settings)


def run_completion(llama: CountingLlama, job: CompletionJob, emit: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(job.prompt, list):
        check_token_ids(job.prompt, llama.n_vocab(), "prompt")
        tokens, offset = job.prompt, len(llama.detokenize(job.prompt).decode("utf-8", "replace"))
    else:
        n_ctx = llama.n_ctx()
        tokens = bounded_tokens(llama, [(job.prompt, False)], add_bos=True, most=n_ctx - 1, window=n_ctx,
                                param="prompt") or [llama.token_bos()]
        offset = len(job.prompt)
    created = int(time.time())

    def chunk(text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        return {"object": "text_completion", "created": created,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    for item in decode(llama, tokens, job.sampling, param="prompt"):
        if isinstance(item, Piece):
            logprobs = None
            if job.sampling.top_logprobs is not None:
                offsets = []
                for lp in item.logprobs:
                    offsets.append(offset)
                    offset += len(lp.token)
                logprobs = {"tokens": [lp.token for lp in item.logprobs],
                            "token_logprobs": [lp.logprob for lp in item.logprobs],
                            "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in item.logprobs],
                            "text_offset": offsets}
            emit(chunk(item.text, logprobs, None))
        else:
            emit(chunk("", None, item.reason))


def embedding_job(body: Any) -> list[str | list[int]]:
    return embedding_inputs(require_object(body))


def run_embeddings(llama: CountingLlama, inputs: list[str | list[int]], stats: GenerationStats,
                   emit: Callable[[dict[str, Any]], None]) -> None:
    n_vocab, most = llama.n_vocab(), min(llama.n_ctx(), llama.n_batch)
    token_lists = []
    for item in inputs:
        if isinstance(item, str):
            tokens = bounded_tokens(llama, [(item, False)], add_bos=True, most=most, window=most, param="input")
        else:
            check_token_ids(item, n_vocab, "input")
            tokens = item
        if len(tokens) > most:
            raise ContextOverflow(len(tokens), most, "input")
        token_lists.append(tokens)
    for index, tokens in enumerate(token_lists):
        if stats.cancel.is_set():
            raise Cancelled()
        vector = _embed(llama, tokens)
        stats.prompt_tokens += len(tokens)
        stats.sync_meter()
        emit({"object": "list", "data": [{"object": "embedding", "index": index, "embedding": vector}]})


def _embed(llama: CountingLlama, tokens: list[int]) -> list[float]:
    n_embd = llama.n_embd()
    batch = llama._batch
    llama._ctx.kv_cache_clear()
    batch.reset()
    batch.add_sequence(tokens, 0, True)
    try:
        llama._ctx.decode(batch)
    finally:
        batch.reset()
    ctx = llama._ctx.ctx
    if llama.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        pointer = ctypes.cast(llama_cpp.llama_get_embeddings(ctx), ctypes.POINTER(ctypes.c_float))
        rows = np.ctypeslib.as_array(pointer, shape=(len(tokens), n_embd))
        vector = rows.astype(np.float64).mean(axis=0)
    else:
        pointer = ctypes.cast(llama_cpp.llama_get_embeddings_seq(ctx, 0), ctypes.POINTER(ctypes.c_float))
        vector = np.ctypeslib.as_array(pointer, shape=(n_embd,)).astype(np.float64)
    llama._ctx.kv_cache_clear()
    llama.reset()
    norm = math.sqrt(float(np.dot(vector, vector)))
    return [float(v) for v in (vector / norm if norm > 0 else vector)]
