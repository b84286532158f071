"""DisconnectWatch: one watcher per request; a disconnect cancels the awaited work in place."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from darkbloom.coordinator.inference.disconnect import ClientDisconnected, DisconnectWatch


class Client:
    """The ASGI receive channel of one request: its body, then a disconnect when the test says so."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.receives = 0

    async def receive(self) -> dict[str, Any]:
        self.receives += 1
        await self.left.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, self.receive)


async def test_work_that_finishes_returns_its_value_and_one_watcher_serves_every_await() -> None:
    client = Client()
    watch = DisconnectWatch(client.request())

    async def work(value: int) -> int:
        await asyncio.sleep(0)
        return value

    assert [await watch.until(work(n)) for n in range(3)] == [0, 1, 2]
    watch.close()
    await asyncio.sleep(0)
    assert client.receives == 1 and not watch.gone


async def test_a_disconnect_cancels_the_work_and_raises_client_disconnected() -> None:
    client = Client()
    watch = DisconnectWatch(client.request())
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    async def leave() -> None:
        await asyncio.sleep(0.01)
        client.left.set()

    leaving = asyncio.create_task(leave())
    with pytest.raises(ClientDisconnected):
        await watch.until(work())
    await leaving
    assert cleaned.is_set() and watch.gone
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the watch's own cancel was taken back

    later = work()
    with pytest.raises(ClientDisconnected):
        await watch.until(later)  # gone already: raised at once, the work never starts
    assert later.cr_frame is None
    watch.close()


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    client = Client()
    watch = DisconnectWatch(client.request())

    async def handler() -> None:
        await watch.until(asyncio.Event().wait())

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()
    assert not watch.gone


async def test_work_that_swallows_the_cancel_still_ends_as_client_disconnected() -> None:
    """asyncio.wait_for on Python 3.11 can swallow a cancel that lands as its future completes."""
    client = Client()
    watch = DisconnectWatch(client.request())

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    async def leave() -> None:
        await asyncio.sleep(0.01)
        client.left.set()

    leaving = asyncio.create_task(leave())
    with pytest.raises(ClientDisconnected):
        await watch.until(work())
    await leaving
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    watch.close()
