"""Racing a piece of request work against the client going away (vLLM's ``with_cancellation``)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection while its request was being worked on."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first (then cancel it and raise ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
