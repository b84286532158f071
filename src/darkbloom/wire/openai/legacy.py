"""Requests of OpenAI's legacy completions (`/v1/completions`) and of embeddings (`/v1/embeddings`):
what a client may send (anything else is a 400 naming its param) and the body a node receives.

The returned bodies keep the client's `model` (and `max_tokens` for completions); the coordinator
sets its own `model`, `stream` and `max_tokens` over them. `stream_options` and `encoding_format`
stay at the edge (the presenters read them from the client's body)."""

from __future__ import annotations

from typing import Any

from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.wire.openai.parameters import check_model, check_sampling, check_stream

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit on one request's inputs
MAX_PROMPTS = 32  # prompts in one legacy completions request (each is generated in turn on one node slot)

LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions without max_tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(x) and x >= 0 for x in value)


def completions_request(body: dict[str, Any]) -> dict[str, Any]:
    """A legacy completions body, checked: its prompt (a string or token ids; a list of one of them
    is that one; a list of up to MAX_PROMPTS of them is a batch, answered with one choice per prompt),
    one choice per prompt (`n` 1, `best_of` at most 1), numbers in range. Unknown fields pass through."""
    check_model(body)
    check_stream(body)
    node = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    node["prompt"] = _prompt(body.get("prompt"))
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise invalid_request(f"'{field}' must be a positive integer.", param=field)
        if value > 1:
            raise invalid_request(f"Only {field}=1 is supported: ask for one completion per request.", param=field)
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not _is_int(value) or value < 1):
            raise invalid_request(f"'{field}' must be a positive integer.", param=field)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 5):
        raise invalid_request("'logprobs' must be an integer from 0 to 5.", param="logprobs")
    check_sampling(body)
    for field in ("echo",):
        if body.get(field) is not None and not isinstance(body[field], bool):
            raise invalid_request(f"'{field}' must be a boolean.", param=field)
    node.setdefault("max_tokens", LEGACY_DEFAULT_MAX_TOKENS)
    if body.get("suffix") is not None and not isinstance(body["suffix"], str):
        raise invalid_request("'suffix' must be a string.", param="suffix")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise invalid_request("'stop' must be a string or a list of at most 4 strings.", param="stop")
    return node


def _prompt(prompt: Any) -> str | list[int] | list[str | list[int]]:
    if isinstance(prompt, str) or _is_token_list(prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, "invalid_request_error", f"'prompt' holds {len(prompt)} prompts; at most "
                           f"{MAX_PROMPTS} fit in one request: send the rest in another.", code="too_many_prompts",
                           param="prompt")
        return prompt[0] if len(prompt) == 1 else prompt
    raise invalid_request("'prompt' must be a string, a list of token ids, or a list of strings or token-id "
                          "lists (one choice each).", param="prompt")


def completion_prompts(body: dict[str, Any]) -> list[Any]:
    """The prompts of a checked legacy completions body (`completions_request`'s): one, or the batch
    a list of several is (a list of token ids is one prompt)."""
    prompt = body.get("prompt")
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def embeddings_request(body: dict[str, Any]) -> dict[str, Any]:
    """`{model, input}` for a node, after checking `input` (a non-empty string, a list of them, a
    list of token ids or a list of token-id lists; at most MAX_EMBEDDING_INPUTS), `encoding_format`
    (`float` or `base64`) and `dimensions` (not supported: every vector has the model's size)."""
    model = check_model(body)
    if body.get("stream") is not None and body["stream"] is not False:
        raise invalid_request("Embeddings are never streamed: leave 'stream' out.", param="stream")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise invalid_request("'encoding_format' must be 'float' or 'base64'.", param="encoding_format")
    if body.get("dimensions") is not None:
        raise invalid_request("'dimensions' is not supported: embeddings have the model's own size.",
                              param="dimensions")
    return {"model": model, "input": _embedding_input(body.get("input"))}


def _embedding_input(value: Any) -> str | list[Any]:
    if isinstance(value, str):
        if not value:
            raise invalid_request("'input' must not be an empty string.", param="input")
        return value
    if not isinstance(value, list) or not value:
        raise invalid_request("'input' must be a non-empty string or a non-empty array.", param="input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise invalid_request(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items.", param="input")
    if _is_token_list(value):
        return value
    for index, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise invalid_request(f"'input[{index}]' must not be an empty string.", param="input")
        elif not _is_token_list(item):
            raise invalid_request("'input' must be a string, an array of strings, an array of token ids or "
                                  "an array of token-id arrays.", param="input")
    if not (all(isinstance(item, str) for item in value) or all(isinstance(item, list) for item in value)):
        raise invalid_request("'input' must not mix strings and token-id arrays.", param="input")
    return value
