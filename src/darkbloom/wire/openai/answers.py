"""The OpenAI edge's answers, the coordinator's and direct mode's: a JSON answer written with
``wire.json_codec`` (orjson; Starlette's ``JSONResponse`` would refuse a NaN a backend sent with a 500,
this writes it as ``null``), and an SSE answer that always tells its owner it ended, however it ended
(the last event sent, the client gone, the task cancelled): the coordinator's request lifecycle
settles there, direct mode's generation frees its slot."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from darkbloom.wire import json_codec

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JsonAnswer(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json_codec.dumps(content)


class AnswerOwner(Protocol):
    def answer_ended(self) -> None:
        """The answer's stream ended, however it ended (called once)."""


class EventStreamResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str], owner: AnswerOwner) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
        self._owner = owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._owner.answer_ended()
