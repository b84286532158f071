"""The stream that serves a request for a node API: the backend's own — or, for a legacy completions
batch (`prompt` a list of several prompts), on any backend: each prompt generated in turn as a
completion of its own, on the one slot the request holds, its chunks sent with the prompt's `index`,
then one usage chunk with the sums. The request's meter counts the whole batch all along, so a
batch stopped early reports what all its prompts used."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from darkbloom.provider.backends.base import (Backend, BackendError, UsageMeter, chunk_usage, is_usage_chunk,
                                              usage_chunk)
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.protocol import Api

_STREAMS = {"chat": "stream_chat", "completions": "stream_completion", "embeddings": "stream_embeddings"}


def open_stream(backend: Backend, api: Api, model_id: str, body: dict[str, Any],
                meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
    """The stream for `api` (the node API a sealed body asks for)."""
    method = getattr(backend, _STREAMS.get(api, ""), None)
    if method is None:
        raise BackendError(400, f"this node does not serve the {api} API", param="model")
    if api == "completions" and len(completion_prompts(body)) > 1:
        return _batch(backend, model_id, body, meter)
    stream: AsyncIterator[dict[str, Any]] = method(model_id, body, meter)
    return stream


async def _batch(backend: Backend, model_id: str, body: dict[str, Any],
                       meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
    whole = meter if meter is not None else UsageMeter()
    prompt_tokens = completion_tokens = cached_tokens = 0
    last: dict[str, Any] = {}
    for index, prompt in enumerate(completion_prompts(body)):
        part = _PartMeter(whole)
        stream = backend.stream_completion(model_id, dict(body, prompt=prompt), part)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for chunk in stream:
                if is_usage_chunk(chunk):
                    usage = chunk_usage(chunk)
                    prompt_tokens += usage.prompt_tokens
                    completion_tokens += usage.completion_tokens
                    cached_tokens += usage.cached_tokens
                    last = chunk
                    continue
                for choice in chunk.get("choices") or ():
                    choice["index"] = index
                yield chunk
        whole.prompt_tokens, whole.completion_tokens = prompt_tokens, completion_tokens
    yield usage_chunk(last.get("id", ""), model_id, last.get("created"), prompt_tokens, completion_tokens,
                      object_name="text_completion", cached_tokens=cached_tokens)


class _PartMeter(UsageMeter):
    """One prompt's meter: what its backend writes lands in the batch's meter, on top of what that held
    when the prompt began (the prompts before it); waiting for the generation to stop is the batch meter's."""

    def __init__(self, whole: UsageMeter) -> None:
        self._whole, self._before = whole, (whole.prompt_tokens, whole.completion_tokens)
        super().__init__()

    @property  # type: ignore[override]
    def prompt_tokens(self) -> int:
        return self._whole.prompt_tokens - self._before[0]

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self._whole.prompt_tokens = self._before[0] + value

    @property  # type: ignore[override]
    def completion_tokens(self) -> int:
        return self._whole.completion_tokens - self._before[1]

    @completion_tokens.setter
    def completion_tokens(self, value: int) -> None:
        self._whole.completion_tokens = self._before[1] + value

    def begin(self) -> None:
        self._whole.begin()

    def end(self) -> None:
        self._whole.end()

    async def stopped(self, timeout: float) -> bool:
        return await self._whole.stopped(timeout)
