"""DisconnectWatch: one watcher per request, once its work takes a while; a disconnect cancels the
work raced against it in place."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import pytest
from starlette.requests import Request

from darkbloom.coordinator.inference.disconnect import WATCH_AFTER, ClientDisconnected, DisconnectWatch

T = TypeVar("T")


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


@pytest.fixture
def client() -> Client:
    return Client()


@pytest.fixture
async def watch(client: Client) -> AsyncIterator[DisconnectWatch]:
    watch = DisconnectWatch(client.request())
    yield watch
    watch.close()


async def hang(started: asyncio.Event) -> None:
    """Work that never ends by itself; ``started`` is set once it is under way."""
    started.set()
    await asyncio.Event().wait()


async def raced(watch: DisconnectWatch, work: Awaitable[T]) -> T:
    """``work`` awaited in the watch's race, as the serving function awaits its steps."""
    with watch.race():
        return await work


def current_cancelling() -> int:
    current = asyncio.current_task()
    assert current is not None
    return current.cancelling()


async def test_work_that_finishes_soon_returns_its_value_and_never_starts_a_watcher(
        client: Client, watch: DisconnectWatch) -> None:
    async def work(value: int) -> int:
        await asyncio.sleep(0)
        return value

    assert [await raced(watch, work(n)) for n in range(3)] == [0, 1, 2]
    watch.close()
    await asyncio.sleep(2 * WATCH_AFTER)
    assert client.receives == 0 and not watch.gone


async def test_one_watcher_serves_every_await_of_longer_work(client: Client, watch: DisconnectWatch) -> None:
    async def work(value: int) -> int:
        await asyncio.sleep(WATCH_AFTER)
        return value

    assert [await raced(watch, work(n)) for n in range(3)] == [0, 1, 2]
    watch.close()
    await asyncio.sleep(0)
    assert client.receives == 1 and not watch.gone


async def test_a_disconnect_cancels_the_work_and_raises_client_disconnected(client: Client,
                                                                            watch: DisconnectWatch) -> None:
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await hang(client.left)  # the client leaves while the work runs
        finally:
            cleaned.set()

    with pytest.raises(ClientDisconnected):
        await raced(watch, work())
    assert cleaned.is_set() and watch.gone
    assert current_cancelling() == 0  # the watch's own cancel was taken back

    ran = False
    with pytest.raises(ClientDisconnected):
        with watch.race():  # gone already: raised at once, the block never runs
            ran = True
    assert not ran


async def test_a_cancel_from_elsewhere_stays_a_cancel(watch: DisconnectWatch) -> None:
    waiting = asyncio.Event()
    task = asyncio.create_task(raced(watch, hang(waiting)))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()
    assert not watch.gone


async def test_work_that_swallows_the_cancel_still_ends_as_client_disconnected(client: Client,
                                                                              watch: DisconnectWatch) -> None:
    """asyncio.wait_for on Python 3.11 can swallow a cancel that lands as its future completes."""
    async def work() -> str:
        try:
            await hang(client.left)  # the client leaves while the work runs
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    with pytest.raises(ClientDisconnected):
        await raced(watch, work())
    assert current_cancelling() == 0
