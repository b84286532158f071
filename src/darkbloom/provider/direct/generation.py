"""One direct-mode chat completion on the node's backend, from its slot to the last SSE event.

A `Generation` holds a slot from before it starts until the backend has stopped generating
(`finish_soon`, exactly once, whatever way the request ends). Streams send nothing before the
first content chunk (`wire.openai.chunks.has_content`), so an early failure is a real HTTP error;
then a final chunk with `usage` and one `data: [DONE]`. A failure after the first chunk ends the
stream with one `data: {"error": …}` event and no `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, AsyncIterator


from darkbloom.wire.openai.streaming import EventStreamResponse
from darkbloom.wire.openai.chunks import SSE_DONE, MessageBuilder, has_content, sse, wants_usage_chunk
from darkbloom.wire.openai.shaping import ChunkShaper
from darkbloom.wire.protocol import Usage
from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.backends.base import UsageMeter, chunk_usage, is_usage_chunk
from darkbloom.provider.direct.errors import from_backend, node_failed
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)

STOP_GRACE = 5.0  # after a stream ends early, how long the slot waits for the backend to stop

_tasks: set[asyncio.Task[None]] = set()  # strong references to the slot-release tasks


class Generation:
    def __init__(self, backend: Backend, model: str, body: dict[str, Any], slots: Slots) -> None:
        self.shaper = ChunkShaper("chatcmpl-" + secrets.token_hex(12), model)
        self.meter = UsageMeter()
        self.slots = slots
        self.usage: Usage | None = None
        self.started = time.monotonic()
        self.include_usage = wants_usage_chunk(body)
        self._stream = backend.stream_chat(model, body, self.meter)
        self._finishing = False

    @property
    def request_id(self) -> str:
        return self.shaper.request_id

    async def next_chunk(self) -> dict[str, Any] | None:
        """The next content chunk, shaped; None at the end (the usage chunk is kept in `self.usage`)."""
        while True:
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                return None
            if not is_usage_chunk(chunk):
                return self.shaper.chunk(chunk)
            self.usage = chunk_usage(chunk)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def head(self) -> list[dict[str, Any]]:
        """The chunks up to the first with content, or all of them (a reply without content): what
        a stream sends first. A chunk with only a role or a finish reason does not end the head."""
        head: list[dict[str, Any]] = []
        while (chunk := await self.next_chunk()) is not None:
            head.append(chunk)
            if has_content(chunk):
                break
        return head

    async def collect(self) -> dict[str, Any]:
        message = MessageBuilder()
        async for chunk in self.chunks():
            message.add(chunk)
        return self.shaper.completion(message, self.final_usage())

    def final_usage(self) -> Usage:
        if self.usage is None:
            raise BackendError(502, "the backend finished without reporting token usage")
        return self.usage

    def finish_soon(self) -> None:
        """Stop the backend (if still running) and free the slot once it has stopped, in a task of its
        own so that neither a cancelled response nor a vanished client can skip it."""
        if self._finishing:
            return
        self._finishing = True
        task = asyncio.get_running_loop().create_task(self._finish(), name=f"finish-{self.request_id}")
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)

    async def _finish(self) -> None:
        try:
            try:
                await self._stream.aclose()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - closing a failed stream may re-raise; nothing to add
                pass
            if not await self.meter.stopped(STOP_GRACE):
                log.warning("direct request %s: the backend did not stop within %.0f s", self.request_id,
                            STOP_GRACE)
        finally:
            self.slots.release()
        counts = self.usage or self.meter
        log.info("direct request %s for %s: %d prompt + %d completion tokens, %.0f ms%s", self.request_id,
                 self.shaper.model, counts.prompt_tokens, counts.completion_tokens,
                 (time.monotonic() - self.started) * 1000, "" if self.usage else " (stopped early)")


async def events(generation: Generation, head: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield sse(chunk)
    try:
        async for chunk in generation.chunks():
            yield sse(chunk)
        final = generation.shaper.usage_chunk(generation.final_usage())
    except BackendError as exc:
        yield sse(from_backend(exc).body())
        return
    except Exception:  # noqa: BLE001 - the stream has started: report in-band, no [DONE]
        log.exception("direct request %s failed mid-stream", generation.request_id)
        yield sse(node_failed().body())
        return
    if generation.include_usage:
        yield sse(final)
    yield SSE_DONE


def generation_response(generation: Generation, head: list[dict[str, Any]],
                        headers: dict[str, str]) -> EventStreamResponse:
    """A streamed completion that always hands its slot back, however the response ends."""
    return EventStreamResponse(events(generation, head), headers, generation.finish_soon)
