"""The caller's view of an answer: our completion id, the model id they asked for, OpenAI's usage
object, and the non-streaming ``chat.completion`` assembled from chunks. Used by the coordinator's
relay and by the node's direct mode alike.

OpenAI's usage object says how many of the prompt tokens the node read from its cache rather than
evaluated (``prompt_tokens_details.cached_tokens``, 0 when none); they count in ``prompt_tokens`` too.

Every presenter's usage object carries ``cost_micro_usd`` when it is given one: the coordinator
gives each answer what its settlement charged (0 when free); direct mode, which charges nothing and
keeps no usage rows, gives none."""

from __future__ import annotations

import time
from typing import Any, Protocol

from darkbloom.wire.openai.chunks import MessageBuilder


class TokenCounts(Protocol):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt tokens, those read from the node's cache


def with_cost(usage: dict[str, Any], cost_micro_usd: int | None) -> dict[str, Any]:
    """An API's usage object with what the request cost, when there is a figure to give."""
    if cost_micro_usd is not None:
        usage["cost_micro_usd"] = cost_micro_usd
    return usage


def usage_dict(usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
    return with_cost({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}, cost_micro_usd)


class ChunkShaper:
    """Rewrites backend chunks into the caller's view: our completion id, the model they asked for.
    `object_` is the streamed chunks' object: chat's by default, `text_completion` for legacy completions."""

    def __init__(self, request_id: str, model: str, object_: str = "chat.completion.chunk") -> None:
        self.request_id = request_id
        self.model = model
        self.object = object_
        self.created = int(time.time())

    def chunk(self, data: dict[str, Any]) -> dict[str, Any]:
        data["id"] = self.request_id
        data["model"] = self.model
        data["object"] = self.object
        data.setdefault("created", self.created)
        return data

    def usage_chunk(self, usage: TokenCounts, cost_micro_usd: int | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [], "usage": usage_dict(usage, cost_micro_usd)}

    def completion(self, message: MessageBuilder, usage: TokenCounts,
                   cost_micro_usd: int | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [message.choice()], "usage": usage_dict(usage, cost_micro_usd)}
