"""One sequence's sampler chain, in llama.cpp's own samplers (the engine's thread).

The chain is llama-cpp-python's (`Llama._init_sampler`): logit bias, repetition penalties over the
last 64 tokens, the grammar, then greedy at temperature 0, else top-k, typical, top-p, min-p,
temperature and a seeded draw. `sample` applies it to one logits row and accepts the token only
when the chain left it a finite logit: with a grammar that allows nothing more (every token banned
by the bias, say) llama.cpp would accept a token the grammar rejects and abort the process, so the
sequence ends there instead, alone.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
import numpy as np

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.params import Sampling

PENALTY_LAST_N = 64
_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


class GrammarDeadEnd(Exception):
    """The grammar (with the logit bias) allows no token at all."""


class SequenceSampler:
    def __init__(self, model: LoadedModel, sampling: Sampling, grammar: str | None, seed: int) -> None:
        """Raises BackendError (400) for a grammar llama.cpp does not parse, or a logit bias for a token
        the model does not have."""
        self._n_vocab = model.n_vocab()
        if any(token >= self._n_vocab for token in sampling.logit_bias):  # checked before loading when known
            raise BackendError(400, "logit_bias keys must be token ids of this model", param="logit_bias")
        self._chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        options = sampling.options
        try:
            if sampling.logit_bias:
                biases = (llama_cpp.llama_logit_bias * len(sampling.logit_bias))()
                for i, (token, bias) in enumerate(sampling.logit_bias.items()):
                    biases[i].token, biases[i].bias = token, bias
                self._add(llama_cpp.llama_sampler_init_logit_bias(self._n_vocab, len(biases), biases))
            self._add(llama_cpp.llama_sampler_init_penalties(
                self._n_vocab, PENALTY_LAST_N, options.get("repeat_penalty", 1.0),
                options.get("frequency_penalty", 0.0), options.get("presence_penalty", 0.0)))
            if grammar is not None:
                sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
                if not sampler:
                    raise BackendError(400, "this model cannot follow the grammar of the request")
                self._add(sampler)
            temp = options.get("temp", 0.8)
            if temp == 0:
                self._add(llama_cpp.llama_sampler_init_greedy())
            else:
                self._add(llama_cpp.llama_sampler_init_top_k(int(options.get("top_k", 40))))
                self._add(llama_cpp.llama_sampler_init_typical(options.get("typical_p", 1.0), 1))
                self._add(llama_cpp.llama_sampler_init_top_p(options.get("top_p", 0.95), 1))
                self._add(llama_cpp.llama_sampler_init_min_p(options.get("min_p", 0.05), 1))
                self._add(llama_cpp.llama_sampler_init_temp(temp))
                self._add(llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        except BaseException:
            self.close()
            raise
        self._data = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
        self._id_column, self._logit_column, self._p_column = self._data["id"], self._data["logit"], self._data["p"]
        self._ids = np.arange(self._n_vocab, dtype=np.intc)
        self._pointer = self._data.ctypes.data_as(llama_cpp.llama_token_data_p)
        self._array = llama_cpp.llama_token_data_array(data=self._pointer, size=self._n_vocab, selected=-1,
                                                       sorted=False)

    def _add(self, sampler: Any) -> None:
        llama_cpp.llama_sampler_chain_add(self._chain, sampler)

    def sample(self, logits: Any) -> int:
        """The next token from one logits row (a `float *`); GrammarDeadEnd when nothing may follow."""
        row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,))
        self._id_column[:] = self._ids  # the chain reorders and shortens the array: filled anew each time
        self._logit_column[:] = row
        self._p_column[:] = 0
        array = self._array
        array.data, array.size, array.selected, array.sorted = self._pointer, self._n_vocab, -1, False
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        selected = array.selected
        if not 0 <= selected < array.size:
            raise GrammarDeadEnd()
        chosen = array.data[selected]
        if not math.isfinite(chosen.logit) and chosen.logit < 0:
            raise GrammarDeadEnd()
        token = int(chosen.id)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
