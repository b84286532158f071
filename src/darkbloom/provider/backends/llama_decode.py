"""What llama.cpp adds to a generation's text stream (`text_stream`): grammars checked before use,
and each token's log-probabilities.

Logprobs are taken from the logits row the token was sampled from (llama.cpp keeps a row for every
sequence that asked for one in the step): the model's own distribution, before grammar, penalties
and temperature.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np

from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.text_stream import TokenLogprob


def check_grammar(model: LoadedModel, grammar: str) -> bool:
    """Whether llama.cpp parses `grammar` (it would crash the sampler chain later if not)."""
    sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def token_logprob(model: LoadedModel, logits: Any, token: int, top_n: int) -> TokenLogprob:
    """The sampled token's log-probability from the logits it was sampled from (a `float *` row)."""
    n_vocab = model.n_vocab()
    row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    shifted = row.astype(np.float64) - float(np.max(row))
    logprobs = shifted - np.log(np.sum(np.exp(shifted)))
    top: list[tuple[str, float, list[int]]] = []
    if top_n:
        best = np.argpartition(-logprobs, top_n)[:top_n]
        for index in sorted(best, key=lambda i: -logprobs[i]):
            alternative = model.detokenize([int(index)])
            top.append((alternative.decode("utf-8", "replace"), float(logprobs[index]), list(alternative)))
    piece = model.detokenize([token])
    return TokenLogprob(piece.decode("utf-8", "replace"), float(logprobs[token]), list(piece), top)
