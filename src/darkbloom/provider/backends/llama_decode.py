"""One generation on a checked-out `Llama`, as text pieces (worker thread).

`decode` drives the library's token loop (`Llama.generate`, which the backend's counting wrapper
counts and cancels) and does what `create_completion` would: UTF-8 held back until a character is
whole, stop sequences (text that may begin one is held back; a stop ends the answer without it),
end-of-generation, `max_tokens` bounded by the context window. Each `Piece` is released text with
the log-probabilities of the tokens whose text it completes.

Logprobs without `logits_all`: while `generate` is suspended at a sampled token, the context still
holds the logits that token was sampled from (the last row, which llama.cpp computes for every
decode), so the log-softmax is taken there. No instance needs `logits_all=True` (which costs
n_ctx × n_vocab floats, ~400 MB for the bundled model at n_ctx 2048) and every instance can answer
with logprobs. They are the model's own distribution, before grammar, penalties and temperature.
"""

from __future__ import annotations

import codecs
import ctypes
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

import llama_cpp
import numpy as np

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_instances import CountingLlama
from darkbloom.provider.backends.params import Sampling


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)

    def chat(self) -> dict[str, Any]:
        """OpenAI's chat shape: `{"token", "logprob", "bytes", "top_logprobs": [...]}`."""
        return {"token": self.token, "logprob": self.logprob, "bytes": self.bytes,
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in self.top]}


@dataclass
class Piece:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Finish:
    reason: str  # "stop" or "length"


class ContextOverflow(BackendError):
    """`tokens` None: found from the prompt's size alone; `at_least`: counting stopped there."""

    def __init__(self, tokens: int | None, n_ctx: int, param: str, *, at_least: bool = False) -> None:
        what = "an input" if param == "input" else "the prompt"
        size = "" if tokens is None else f"at least {tokens} tokens, " if at_least else f"{tokens} tokens, "
        super().__init__(400, f"{what} is {size}too long for this model's context window of {n_ctx}",
                         param=param, code="context_length_exceeded")


def check_grammar(llama: llama_cpp.Llama, grammar: str) -> bool:
    """Whether llama.cpp parses `grammar` (it would crash the sampler chain later if not)."""
    sampler = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def decode(llama: CountingLlama, prompt: list[int], sampling: Sampling, *, param: str,
           grammar: str | None = None, extra_stops: tuple[str, ...] = ()) -> Iterator[Piece | Finish]:
    n_ctx = llama.n_ctx()
    if len(prompt) >= n_ctx:
        raise ContextOverflow(len(prompt), n_ctx, param)
    if any(token >= llama.n_vocab() for token in sampling.logit_bias):  # checked before loading when known
        raise BackendError(400, "logit_bias keys must be token ids of this model", param="logit_bias")
    room = n_ctx - len(prompt)
    max_tokens = min(sampling.max_tokens or room, room)
    seed = sampling.seed if sampling.seed is not None else random.Random(llama._seed).randint(0, 2**32)
    llama.set_seed(seed & 0xFFFFFFFF)
    stops = [s for s in (*sampling.stop, *extra_stops) if s]
    grammar_obj = llama_cpp.LlamaGrammar.from_string(grammar, verbose=False) if grammar else None
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""  # decoded, not yet released
    waiting: list[tuple[int, TokenLogprob]] = []  # logprobs, each with where its token's text ends
    released = 0  # characters released so far (over the whole answer)
    sampled, reason, cut = 0, "length", False
    llama.logit_bias = sampling.logit_bias
    try:
        for token in llama.generate(prompt, grammar=grammar_obj, **sampling.options):
            if llama_cpp.llama_vocab_is_eog(llama._model.vocab, token):
                reason = "stop"
                break
            sampled += 1
            piece = llama.detokenize([token])
            logprob = _logprob(llama, token, piece, sampling.top_logprobs) if sampling.top_logprobs is not None \
                else None
            pending += utf8.decode(piece)
            if logprob is not None:
                waiting.append((released + len(pending), logprob))
            hit = _first_stop(pending, stops)
            if hit is not None:
                pending, reason, cut = pending[:hit], "stop", True
                break
            keep = _held_back(pending, stops)
            if len(pending) > keep:
                text, pending = pending[: len(pending) - keep], pending[len(pending) - keep:]
                released += len(text)
                yield Piece(text, _take(waiting, released))
            if sampled >= max_tokens:
                break
    finally:
        llama.logit_bias = {}
    if not cut:
        pending += utf8.decode(b"", final=True)
    released += len(pending)
    last = _take(waiting, released)  # what is still waiting was part of a stop sequence: dropped
    if pending or last:
        yield Piece(pending, last)
    yield Finish(reason)


def _take(waiting: list[tuple[int, TokenLogprob]], released: int) -> list[TokenLogprob]:
    """The logprobs of tokens whose text is now released (the rest stay waiting)."""
    done = [lp for end, lp in waiting if end <= released]
    waiting[:] = [(end, lp) for end, lp in waiting if end > released]
    return done


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could begin a stop sequence (kept until the next token says)."""
    keep = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:n]):
                keep = n
                break
    return keep


def _logprob(llama: llama_cpp.Llama, token: int, piece: bytes, top_n: int) -> TokenLogprob:
    """The sampled token's log-probability, from the logits it was sampled from (see the docstring)."""
    n_vocab = llama.n_vocab()
    pointer = llama_cpp.llama_get_logits_ith(llama._ctx.ctx, -1)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    shifted = logits.astype(np.float64) - float(np.max(logits))
    logprobs = shifted - np.log(np.sum(np.exp(shifted)))
    top: list[tuple[str, float, list[int]]] = []
    if top_n:
        best = np.argpartition(-logprobs, top_n)[:top_n]
        for index in sorted(best, key=lambda i: -logprobs[i]):
            alternative = llama.detokenize([int(index)])
            top.append((alternative.decode("utf-8", "replace"), float(logprobs[index]), list(alternative)))
    return TokenLogprob(piece.decode("utf-8", "replace"), float(logprobs[token]), list(piece), top)
