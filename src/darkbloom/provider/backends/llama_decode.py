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
from darkbloom.provider.backends.text_stream import TokenLogprob, token_logprob


def check_grammar(model: LoadedModel, grammar: str) -> bool:
    """Whether llama.cpp parses `grammar` (it would crash the sampler chain later if not)."""
    sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def logits_logprob(model: LoadedModel, logits: Any, token: int, top_n: int) -> TokenLogprob:
    """The sampled token's log-probability from the logits it was sampled from (a `float *` row)."""
    row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(model.n_vocab(),))
    shifted = row.astype(np.float64) - float(np.max(row))
    return token_logprob(model, shifted - np.log(np.sum(np.exp(shifted))), token, top_n)
