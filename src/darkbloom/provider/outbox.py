"""The frames waiting for one coordinator connection's writer, the only task that sends on it, so
concurrent requests never interleave writes. Once the connection is gone the outbox is closed and
takes nothing more."""

from __future__ import annotations

import asyncio
from typing import Protocol

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection

from darkbloom.wire import protocol


class _Request(Protocol):
    cancelled: bool


class Outbox:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[_Request | None, str]] = asyncio.Queue()
        self.closed = False

    def send(self, frame: BaseModel, request: _Request | None = None) -> None:
        """Queue `frame`. One queued with its request is dropped if the request is cancelled before it
        goes; one queued with None (not a request's, or the usage report after a cancel) always goes."""
        if not self.closed and (request is None or not request.cancelled):
            self._queue.put_nowait((request, protocol.dump(frame)))

    def close(self) -> None:
        self.closed = True

    async def write_to(self, ws: ClientConnection) -> None:
        while True:
            request, text = await self._queue.get()
            if request is None or not request.cancelled:
                await ws.send(text)


def closed_outbox() -> Outbox:
    outbox = Outbox()
    outbox.close()
    return outbox
