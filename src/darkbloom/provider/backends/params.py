"""OpenAI request bodies → checked settings for the in-process backends (llama.cpp, MLX).

Known parameters are type-checked (a bad value is a 400 naming the parameter in `param`);
parameters llama.cpp has no use for (user, metadata, store, stream_options, …) are ignored.
Tools and structured output are `tool_params`' job; messages are `chat_prompt`'s.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from darkbloom.provider.backends.base import BackendError
from darkbloom.wire.openai.parameters import COMPLETION_SAMPLING_DEFAULTS

_FLOATS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "repeat_penalty": (0.0, 10.0),
}
_INTS: dict[str, tuple[int, int]] = {"top_k": (0, 1_000_000), "seed": (-(2**63), 2**64 - 1)}
MAX_STOPS = 4
DEFAULT_SEED = random.Random(0xFFFFFFFF).randint(0, 2**32)  # what `Llama(seed=default)` drew
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit; each input is a decode of its own


@dataclass
class Sampling:
    """How to sample one generation (`llama_sampler` or `mlx_sampling`, `text_stream.TextStream`)."""

    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    options: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, … as `Llama.generate` names them

    def seed_or_default(self) -> int:
        """The request's seed, else the node's fixed one (as llama-cpp-python's default seed gave it)."""
        return self.seed if self.seed is not None else DEFAULT_SEED


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BackendError(400, "the request body must be a JSON object", param="body")
    return body


def sampling(body: dict[str, Any], defaults: dict[str, Any], n_vocab: int | None = None) -> Sampling:
    """The sampling settings every generating API shares (chat and legacy completions)."""
    out = Sampling()
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None and out.max_tokens is None:
            if not _is_int(value) or value < 1:
                raise BackendError(400, f"{name} must be a positive integer", param=name)
            out.max_tokens = value
    for name in ("n", "best_of"):
        if body.get(name) is not None and body[name] != 1:
            raise BackendError(400, f"{name} must be 1: this backend returns one choice per request", param=name)
    settings = dict(defaults)
    for name, (low, high) in _FLOATS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise BackendError(400, f"{name} must be a number between {low:g} and {high:g}", param=name)
        settings[name] = float(value)
    for name, (low, high) in _INTS.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or not low <= value <= high:
            raise BackendError(400, f"{name} must be an integer between {low} and {high}", param=name)
        settings[name] = value
    out.seed = settings.pop("seed", None)
    out.options = {("temp" if k == "temperature" else k): v for k, v in settings.items()}
    out.stop = _stop(body.get("stop"))
    out.logit_bias = _logit_bias(body.get("logit_bias"), n_vocab)
    return out


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """`logprobs: true` (with `top_logprobs` 0–20) → how many alternatives per token; None when off."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BackendError(400, "logprobs must be true or false", param="logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise BackendError(400, "top_logprobs must be an integer between 0 and 20", param="top_logprobs")
    if top is not None and not logprobs:
        raise BackendError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if logprobs else None


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """A legacy completion's prompt: a string, a list of one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    raise BackendError(400, "prompt must be a string (or a list of one string, or a list of token ids)",
                       param="prompt")


def completion_options(body: dict[str, Any]) -> int | None:
    """A legacy completion's `logprobs` (0–5 alternatives per token) after refusing what is not served."""
    if body.get("echo"):
        raise BackendError(400, "echo is not supported by this backend", param="echo")
    if body.get("suffix"):
        raise BackendError(400, "suffix is not supported by this backend", param="suffix")
    logprobs = body.get("logprobs")
    if logprobs is None or logprobs is False:
        return None
    if not _is_int(logprobs) or not 0 <= logprobs <= 5:
        raise BackendError(400, "logprobs must be an integer between 0 and 5", param="logprobs")
    return logprobs


def embedding_inputs(body: dict[str, Any]) -> list[str | list[int]]:
    """`input` as a list of texts or of token-id lists (a string, strings, token ids, token-id lists)."""
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BackendError(400, "input must be a non-empty string, list of strings or list of token ids",
                           param="input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise BackendError(400, f"input may hold at most {MAX_EMBEDDING_INPUTS} inputs", param="input")
    for item in value:
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item):
            continue
        raise BackendError(400, "every input must be a non-empty string or list of token ids", param="input")
    return value


def check_token_ids(tokens: list[int], n_vocab: int, param: str) -> None:
    if any(t >= n_vocab for t in tokens):
        raise BackendError(400, f"{param} has a token id outside this model's vocabulary of {n_vocab}",
                           param=param)


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise BackendError(400, f"stop must be a string or a list of up to {MAX_STOPS} strings", param="stop")
    return [s for s in stop if s]


def _logit_bias(bias: Any, n_vocab: int | None) -> dict[int, float]:
    """OpenAI's `{"token id": -100…100}`; -100 bans the token, as OpenAI documents."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise BackendError(400, "logit_bias must map token ids to numbers", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or (n_vocab is not None and token >= n_vocab):
            raise BackendError(400, "logit_bias keys must be token ids of this model", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BackendError(400, "logit_bias values must be numbers between -100 and 100", param="logit_bias")
        out[token] = -math.inf if value <= -100 else float(value)
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class CompletionJob:
    """A legacy completion's checked prompt and sampling (event loop: a 400 before any work)."""

    prompt: str | list[int]
    sampling: Sampling


def completion_job(body: Any, n_vocab: int | None) -> CompletionJob:
    body = require_object(body)
    prompt = completion_prompt(body)
    settings = sampling(body, COMPLETION_SAMPLING_DEFAULTS, n_vocab)
    settings.top_logprobs = completion_options(body)
    return CompletionJob(prompt, settings)
