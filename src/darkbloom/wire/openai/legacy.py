"""Requests of OpenAI's legacy completions (`/v1/completions`) and of embeddings (`/v1/embeddings`):
what a client may send (anything else is a 400 naming its param) and the body a node receives.

The returned bodies keep the client's `model` (and `max_tokens` for completions); the coordinator
sets its own `model`, `stream` and `max_tokens` over them. `stream_options` and `encoding_format`
stay at the edge (the presenters read them from the client's body)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.openai.body_schema import OPEN, BodySchema, Refusal
from darkbloom.wire.openai.parameters import (MODEL_REFUSAL, SAMPLING_REFUSALS, STREAM_REFUSAL, Model, PositiveInt,
                                              Sampling)

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit on one request's inputs
MAX_PROMPTS = 32  # prompts in one legacy completions request (each is generated in turn on one node slot)

LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions without max_tokens

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _list_kind(value: object, kinds: dict[type, str]) -> str | None:
    """Which member of a union ``value`` is meant to be: "text" for a string, else by the type of
    its first item; None (no member: the field's own 400) for anything else."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and not isinstance(value[0], bool):
        return next((tag for kind, tag in kinds.items() if isinstance(value[0], kind)), None)
    return None


def _prompt_kind(value: object) -> str | None:
    return _list_kind(value, {int: "token_ids", str: "batch", list: "batch"})


Prompt = Annotated[Union[
    Annotated[str, Tag("text")],
    Annotated[TokenIds, Tag("token_ids")],
    Annotated[list[Union[str, TokenIds]], Field(min_length=1, max_length=MAX_PROMPTS), Tag("batch")],
], Discriminator(_prompt_kind), Field(description=(
    "A string or token ids; a list of up to 32 of them is a batch, answered with one choice per prompt."))]


@with_config(OPEN)
class CompletionRequest(Sampling):
    """OpenAI legacy completions (a raw prompt, no chat template)."""

    model: Model
    prompt: Prompt
    stream: NotRequired[bool | None]
    n: NotRequired[Annotated[int, Field(ge=1, le=1)] | None]
    best_of: NotRequired[Annotated[int, Field(ge=1, le=1)] | None]
    max_tokens: NotRequired[Annotated[int, Field(ge=1, json_schema_extra={"default": LEGACY_DEFAULT_MAX_TOKENS})] | None]
    max_completion_tokens: NotRequired[PositiveInt | None]
    logprobs: NotRequired[Annotated[int, Field(ge=0, le=5)] | None]
    echo: NotRequired[bool | None]
    suffix: NotRequired[str | None]
    stop: NotRequired[str | Annotated[list[str], Field(max_length=4)] | None]


COMPLETION_REQUEST = BodySchema(CompletionRequest, {
    "model": MODEL_REFUSAL,
    "stream": STREAM_REFUSAL,
    "prompt": "'prompt' must be a string, a list of token ids, or a list of strings or token-id lists (one "
              "choice each).",
    "prompt/too_long": Refusal("'prompt' holds {actual_length} prompts; at most {max_length} fit in one request: "
                               "send the rest in another.", code="too_many_prompts"),
    "n": "'n' must be a positive integer.",
    "n/less_than_equal": "Only n=1 is supported: ask for one completion per request.",
    "best_of": "'best_of' must be a positive integer.",
    "best_of/less_than_equal": "Only best_of=1 is supported: ask for one completion per request.",
    "max_tokens": "'max_tokens' must be a positive integer.",
    "max_completion_tokens": "'max_completion_tokens' must be a positive integer.",
    "logprobs": "'logprobs' must be an integer from 0 to 5.",
    **SAMPLING_REFUSALS,
    "echo": "'echo' must be a boolean.",
    "suffix": "'suffix' must be a string.",
    "stop": "'stop' must be a string or a list of at most 4 strings.",
})


def completions_request(body: dict[str, Any]) -> dict[str, Any]:
    """A legacy completions body, checked: its prompt (a string or token ids; a list of one of them
    is that one; a list of up to MAX_PROMPTS of them is a batch, answered with one choice per prompt),
    one choice per prompt (`n` 1, `best_of` at most 1), numbers in range. Unknown fields pass through."""
    COMPLETION_REQUEST.validate(body)
    node = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    prompts = completion_prompts(body)
    if len(prompts) == 1:
        node["prompt"] = prompts[0]
    node.setdefault("max_tokens", LEGACY_DEFAULT_MAX_TOKENS)
    return node


def completion_prompts(body: dict[str, Any]) -> list[Any]:
    """The prompts of a checked legacy completions body (`completions_request`'s): one, or the batch
    a list of several is (a list of token ids is one prompt)."""
    prompt = body.get("prompt")
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _input_kind(value: object) -> str | None:
    return _list_kind(value, {int: "token_ids", str: "texts", list: "token_id_lists"})


Inputs = Annotated[Union[
    Annotated[str, Field(min_length=1), Tag("text")],
    Annotated[TokenIds, Field(max_length=MAX_EMBEDDING_INPUTS), Tag("token_ids")],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
              Tag("texts")],
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS), Tag("token_id_lists")],
], Discriminator(_input_kind)]


@with_config(OPEN)
class EmbeddingRequest(TypedDict):
    model: Model
    input: Inputs
    encoding_format: NotRequired[Literal["float", "base64"] | None]
    dimensions: NotRequired[Annotated[None, Field(description="Not supported: vectors have the model's size.")]]
    stream: NotRequired[Literal[False] | None]


EMBEDDING_REQUEST = BodySchema(EmbeddingRequest, {
    "model": MODEL_REFUSAL,
    "input": "'input' must be a non-empty string or a non-empty array.",
    "input/string_too_short": "'input' must not be an empty string.",
    "input/too_long": f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items.",
    "input[*]/string_too_short": Refusal("'{param}' must not be an empty string.", param="input"),
    "input[*]": Refusal("'input' must be a string, an array of strings, an array of token ids or an array of "
                        "token-id arrays (not a mix of strings and token-id arrays).", param="input"),
    "encoding_format": "'encoding_format' must be 'float' or 'base64'.",
    "dimensions": "'dimensions' is not supported: embeddings have the model's own size.",
    "stream": "Embeddings are never streamed: leave 'stream' out.",
})


def embeddings_request(body: dict[str, Any]) -> dict[str, Any]:
    """`{model, input}` for a node, after checking `input` (a non-empty string, a list of them, a
    list of token ids or a list of token-id lists; at most MAX_EMBEDDING_INPUTS), `encoding_format`
    (`float` or `base64`) and `dimensions` (not supported: every vector has the model's size)."""
    EMBEDDING_REQUEST.validate(body)
    return {"model": body["model"].strip(), "input": body["input"]}
