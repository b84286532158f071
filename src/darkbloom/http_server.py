"""The uvicorn server every HTTP listener of Darkbloom runs: the coordinator, a node's direct mode, the demo.

uvicorn's own loop wakes ten times a second to refresh its ``Date`` header and to look for a stop, so
an idle coordinator, or an idle node on someone's laptop, woke ten times a second for nothing. This
one ticks once a second (the header's resolution) and wakes at once when told to stop.

A server stopped by a signal (the process is ending) first freezes what it holds out of the cyclic
garbage collector's reach: closing 10,000 node sockets allocates enough to set off full collections,
each a walk over every session's objects, none of which the collector would free before the process
ends anyway. (One stopped otherwise — a test's, the demo's, direct mode's — may leave a process that
goes on: it does not.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from typing import Iterator

import uvicorn

TICK = 1.0


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, own_signals: bool = True) -> None:
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        super().__init__(config)
        self.own_signals = own_signals  # False: the embedding program owns SIGINT / SIGTERM and stops us

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set by a signal, by the embedding program or from another thread: the tick wakes at once."""
        self._stopping = value
        loop, wake = self._loop, self._wake
        if value and loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has just closed: nothing left to wake
                loop.call_soon_threadsafe(wake.set)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.own_signals:
            with super().capture_signals():
                yield
        else:
            yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._captured_signals:  # SIGINT / SIGTERM: the process ends with this server
            gc.freeze()
        await super().shutdown(sockets)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        try:
            counter = 0
            while not await self.on_tick(counter):
                counter = (counter + 10) % 864000  # uvicorn's on_tick counts tenths of a second
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK):
                        await self._wake.wait()
        finally:
            self._loop = self._wake = None
