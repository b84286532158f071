"""One direct-mode request on the node's backend, whatever its API, from its slot to the last event.

A `Generation` holds a slot from before it starts until the backend has stopped generating
(`answer_ended`, exactly once, whatever way the request ends). Its presenter (`wire.openai.presenters`)
gives the answer the caller's API shape. Streams send nothing before the first content chunk
(`wire.openai.chunks.has_content`), so an early failure is a real HTTP error; then the presenter's
events to its closing ones (chat: a usage chunk on request and one `data: [DONE]`). A failure after
the first chunk ends the stream with the presenter's error event (chat: one `data: {"error": …}`
and no `[DONE]`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from darkbloom.wire.openai.chunks import has_content
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.openai.answers import EventStreamResponse
from darkbloom.wire.protocol import Api, Usage
from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.backends.base import UsageMeter, chunk_usage, is_usage_chunk
from darkbloom.provider.backends.streams import open_stream
from darkbloom.provider.direct.errors import from_backend, node_failed
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)

STOP_GRACE = 5.0  # after a stream ends early, how long the slot waits for the backend to stop

_tasks: set[asyncio.Task[None]] = set()  # strong references to the slot-release tasks


class Generation:
    def __init__(self, backend: Backend, api: Api, model: str, body: dict[str, Any], presenter: Presenter,
                 request_id: str, slots: Slots) -> None:
        self.presenter = presenter
        self.request_id = request_id
        self.model = model
        self.meter = UsageMeter()
        self.slots = slots
        self.usage: Usage | None = None
        self.started = time.monotonic()
        self._finishing = False
        self._stream = open_stream(backend, api, model, body, self.meter)  # BackendError: the API is not served

    async def next_chunk(self) -> dict[str, Any] | None:
        """The next content chunk as the node sent it; None at the end (the usage chunk is kept in
        `self.usage`)."""
        while True:
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                return None
            if not is_usage_chunk(chunk):
                return chunk
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
        async for chunk in self.chunks():
            self.presenter.collect(chunk)
        return self.presenter.response(self.final_usage())

    def final_usage(self) -> Usage:
        if self.usage is None:
            raise BackendError(502, "the backend finished without reporting token usage")
        return self.usage

    def answer_ended(self) -> None:
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
                 self.model, counts.prompt_tokens, counts.completion_tokens,
                 (time.monotonic() - self.started) * 1000, "" if self.usage else " (stopped early)")


async def events(generation: Generation, head: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    presenter = generation.presenter
    for part in presenter.stream_start():
        yield part
    for chunk in head:
        for part in presenter.stream_chunk(chunk):
            yield part
    try:
        async for chunk in generation.chunks():
            for part in presenter.stream_chunk(chunk):
                yield part
        usage = generation.final_usage()
    except BackendError as exc:
        for part in presenter.stream_error(from_backend(exc)):
            yield part
        return
    except Exception:  # noqa: BLE001 - the stream has started: report in-band
        log.exception("direct request %s failed mid-stream", generation.request_id)
        for part in presenter.stream_error(node_failed()):
            yield part
        return
    for part in presenter.stream_end(usage):
        yield part


def generation_response(generation: Generation, head: list[dict[str, Any]],
                        headers: dict[str, str]) -> EventStreamResponse:
    """A streamed answer that always hands its slot back, however the response ends."""
    return EventStreamResponse(events(generation, head), headers, generation)
