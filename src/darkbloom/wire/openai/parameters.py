"""The request parameters several APIs share, as schema types (`body_schema`) with what their 400s
say: the `model` every one names, `stream`, the output bound and the ranges of the sampling numbers
(chat, which Responses and Messages become, and legacy completions); and the numbers a node samples
with when a request leaves them out."""

from __future__ import annotations

from typing import Annotated, Any, Mapping

from pydantic import Field, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.wire.openai.body_schema import OPEN

SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                   "frequency_penalty": (-2.0, 2.0)}
# llama-cpp-python's own defaults for a chat completion and for a prompt completion: the llama.cpp
# backend samples with them, and the Responses API reports them as the numbers used
CHAT_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "typical_p": 1.0,
                          "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
COMPLETION_SAMPLING_DEFAULTS = {**CHAT_SAMPLING_DEFAULTS, "temperature": 0.8}

Model = Annotated[str, Field(pattern=r"\S", examples=[BUNDLED_MODEL_ID], description=(
    "A catalog model id or alias, or (self-routed) a model your own machines serve."))]
PositiveInt = Annotated[int, Field(ge=1)]


@with_config(OPEN)
class Sampling(TypedDict):
    temperature: NotRequired[Annotated[float, Field(ge=0, le=2)] | None]
    top_p: NotRequired[Annotated[float, Field(ge=0, le=1)] | None]
    presence_penalty: NotRequired[Annotated[float, Field(ge=-2, le=2)] | None]
    frequency_penalty: NotRequired[Annotated[float, Field(ge=-2, le=2)] | None]


MODEL_REFUSAL = "'model' is required: a model id (GET /v1/models lists the ones you can use)."
STREAM_REFUSAL = "'stream' must be a boolean."
SAMPLING_REFUSALS = {field: f"'{field}' must be a number from {low:g} to {high:g}."
                     for field, (low, high) in SAMPLING_RANGES.items()}


def chat_sampling(body: Mapping[str, Any]) -> dict[str, float]:
    """The OpenAI sampling numbers (SAMPLING_RANGES) a chat request samples with: each as the request
    gives it, else CHAT_SAMPLING_DEFAULTS'."""
    return {field: float(body[field]) if body.get(field) is not None else CHAT_SAMPLING_DEFAULTS[field]
            for field in SAMPLING_RANGES}
