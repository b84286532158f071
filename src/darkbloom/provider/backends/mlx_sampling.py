"""One sequence's sampling on MLX, from the request's checked settings (`params.Sampling`): logits
processors (logit bias, repetition, presence and frequency penalties over the last PENALTY_LAST_N
tokens, mlx-lm's own) and a sampler (greedy at temperature 0; else top-k, top-p and min-p filters,
mlx-lm's, then a draw with the sequence's own random key, so a seed gives the same answer whatever
else the batch holds). `typical_p` has no MLX counterpart and is not applied.

Both are made on the engine's thread (their MLX arrays belong to it); `check` runs before, where the
request is prepared."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, make_frequency_penalty,
                                 make_presence_penalty, make_repetition_penalty)

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.params import Sampling

PENALTY_LAST_N = 64  # as the llama.cpp backend's
Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def check(sampling: Sampling, n_vocab: int) -> None:
    """Raises BackendError (400) for a logit bias on a token the model does not have."""
    if any(token >= n_vocab for token in sampling.logit_bias):
        raise BackendError(400, "logit_bias keys must be token ids of this model", param="logit_bias")


def logits_processors(sampling: Sampling) -> list[LogitsProcessor]:
    processors: list[LogitsProcessor] = []
    options = sampling.options
    if sampling.logit_bias:
        indices = mx.array(list(sampling.logit_bias))
        values = mx.array(list(sampling.logit_bias.values()), dtype=mx.float32)

        def bias(tokens: mx.array, logits: mx.array) -> mx.array:
            return logits.at[:, indices].add(values.astype(logits.dtype))

        processors.append(bias)
    if options.get("repeat_penalty", 1.0) != 1.0:
        processors.append(make_repetition_penalty(options["repeat_penalty"], PENALTY_LAST_N))
    if options.get("presence_penalty", 0.0):
        processors.append(make_presence_penalty(options["presence_penalty"], PENALTY_LAST_N))
    if options.get("frequency_penalty", 0.0):
        processors.append(make_frequency_penalty(options["frequency_penalty"], PENALTY_LAST_N))
    return processors


def sampler(sampling: Sampling) -> Sampler:
    options: dict[str, Any] = sampling.options
    temperature = float(options.get("temp", 0.8))
    if temperature == 0:
        return _greedy
    filters: list[Sampler] = []
    top_k = int(options.get("top_k", 0))
    if top_k > 0:
        filters.append(lambda logprobs: apply_top_k(logprobs, top_k))
    top_p = float(options.get("top_p", 1.0))
    if 0 < top_p < 1:
        filters.append(lambda logprobs: apply_top_p(logprobs, top_p))
    min_p = float(options.get("min_p", 0.0))
    if min_p > 0:
        filters.append(lambda logprobs: apply_min_p(logprobs, min_p))
    key = [mx.random.key(sampling.seed_or_default() % 2**64)]

    def draw(logprobs: mx.array) -> mx.array:
        for keep in filters:
            logprobs = keep(logprobs)
        key[0], now = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1.0 / temperature), key=now)

    return draw


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)
