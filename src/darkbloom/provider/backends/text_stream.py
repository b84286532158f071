"""A generation's tokens as text pieces, the same for every in-process backend.

`TextStream` takes the tokens one sequence samples (on its engine's thread): UTF-8 held back until
a character is whole, stop sequences (text that may begin one is held back; a stop ends the answer
without it), end-of-generation, `max_tokens` bounded by the context window. Each `Piece` is released
text with the log-probabilities of the tokens whose text it completes.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, Protocol

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.params import Sampling


class Vocabulary(Protocol):
    """What a stream needs of a model's tokenizer."""

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends the generation (end of turn, end of text)."""
        ...

    def detokenize(self, tokens: list[int]) -> bytes:
        """The bytes `tokens` stand for (a token may hold part of a UTF-8 character)."""
        ...


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


class TextStream:
    """One generation's sampled tokens → released text (`push`, on the engine's thread).

    `max_tokens` is bounded by the room the prompt leaves in the window; `completion_tokens` counts
    every token pushed but an end-of-generation one."""

    def __init__(self, model: Vocabulary, sampling: Sampling, *, room: int,
                 extra_stops: tuple[str, ...] = ()) -> None:
        self.model = model
        self.max_tokens = min(sampling.max_tokens or room, room)
        self.stops = [s for s in (*sampling.stop, *extra_stops) if s]
        self.completion_tokens = 0
        self.done = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet released
        self._waiting: list[tuple[int, TokenLogprob]] = []  # logprobs, each with where its token's text ends
        self._released = 0  # characters released so far (over the whole answer)

    def push(self, token: int, logprob: TokenLogprob | None = None) -> list[Piece | Finish]:
        """The text this token releases; the last item is a `Finish` once the answer is over."""
        assert not self.done
        if self.model.is_eog(token):
            return self._finish("stop", cut=False)
        self.completion_tokens += 1
        piece = self.model.detokenize([token])
        self._pending += self._utf8.decode(piece)
        if logprob is not None:
            self._waiting.append((self._released + len(self._pending), logprob))
        hit = _first_stop(self._pending, self.stops)
        if hit is not None:
            self._pending = self._pending[:hit]
            return self._finish("stop", cut=True)
        out: list[Piece | Finish] = []
        keep = _held_back(self._pending, self.stops)
        if len(self._pending) > keep:
            text, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            self._released += len(text)
            out.append(Piece(text, _take(self._waiting, self._released)))
        if self.completion_tokens >= self.max_tokens:
            out += self._finish("length", cut=False)
        return out

    def _finish(self, reason: str, *, cut: bool) -> list[Piece | Finish]:
        self.done = True
        pending = self._pending if cut else self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        self._released += len(pending)
        last = _take(self._waiting, self._released)  # what is still waiting was part of a stop sequence: dropped
        return [*([Piece(pending, last)] if pending or last else []), Finish(reason)]


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


def token_logprob(vocab: Vocabulary, logprobs: Any, token: int, top_n: int) -> TokenLogprob:
    """The sampled token's log-probability, and its `top_n` alternatives, from `logprobs`: a numpy row of
    the distribution it was sampled from (log-softmax already applied)."""
    import numpy as np

    top: list[tuple[str, float, list[int]]] = []
    if top_n:
        best = np.argpartition(-logprobs, top_n)[:top_n]
        for index in sorted(best, key=lambda i: -logprobs[i]):
            alternative = vocab.detokenize([int(index)])
            top.append((alternative.decode("utf-8", "replace"), float(logprobs[index]), list(alternative)))
    piece = vocab.detokenize([token])
    return TokenLogprob(piece.decode("utf-8", "replace"), float(logprobs[token]), list(piece), top)
