"""An SSE answer that always runs its end hook, however the response ends (the last event sent, the
client gone, the task cancelled): the coordinator settles its request there, direct mode frees its slot."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str], on_end: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()
