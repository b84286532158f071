"""Upper bounds the coordinator can compute without the model's tokenizer.

Prompt tokens: `wire.token_bounds.prompt_token_bound` of the body the node receives (the node clamps
what it reports to the same bound); the output bound from max_tokens and the catalog; the context a
request needs from both.
"""

from __future__ import annotations

from darkbloom.wire import token_bounds
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.coordinator.inference.calls import InferenceCall

BYTES_PER_TOKEN = 4  # about what English text takes per token with a byte-level BPE vocabulary


def prompt_token_bound(call: InferenceCall) -> int:
    return token_bounds.prompt_token_bound(call.api, call.body)


def output_token_bound(call: InferenceCall, model: CatalogModel) -> int:
    """The request's output bound: max_completion_tokens / max_tokens, at most the catalog's maximum,
    for each of its choices (embeddings generate nothing)."""
    if call.api == "embeddings":
        return 0
    each = model.max_output_tokens if call.max_tokens is None else min(call.max_tokens, model.max_output_tokens)
    return each * call.choices


def context_needed(call: InferenceCall, prompt_bound: int, output_bound: int) -> int:
    """The context the request may take (docs/models.md "Context length"): its prompt at
    ``BYTES_PER_TOKEN``, plus the max_tokens it asked for (capped as the reservation caps it), or
    plus one token when it asked for none (a node ends the answer where its context ends,
    finish_reason "length"); for a completions batch, its longest prompt and one choice's output.
    0 for embeddings: each input is its own sequence, which the node checks.

    Not the prompt's bound: that counts a token per byte, about four times what ordinary text
    takes, and would turn away prompts a node serves. A prompt this estimate counts low (code,
    digits, other scripts) is refused by the node, which counts exactly."""
    if call.api == "embeddings":
        return 0
    if call.choices > 1:  # a completions batch: each prompt is a sequence of its own
        prompt_bound = max(token_bounds.prompt_token_bound(call.api, dict(call.body, prompt=prompt))
                           for prompt in completion_prompts(call.body))
        output_bound //= call.choices
    return prompt_estimate(prompt_bound) + (output_bound if call.max_tokens is not None else 1)


def prompt_estimate(prompt_bound: int) -> int:
    """The prompt's tokens as the coordinator estimates them (its bound at ``BYTES_PER_TOKEN``): what
    the context check counts, and what ``POST /v1/messages/count_tokens`` answers."""
    return -(-prompt_bound // BYTES_PER_TOKEN)
