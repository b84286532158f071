"""The node's one concurrency limit (`max_concurrency`), shared by fleet and direct-mode requests.

Fleet requests take a slot only if one is free at once (`try_acquire`); when none is, the node
answers 429 and the coordinator places the request elsewhere. Direct-mode requests come from the
machine's own user and may wait for a slot (`acquire`), first come first served; while any of them
waits, a freed slot goes to it, never to a fleet request arriving at that moment.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a node needs at least one slot")
        self.limit = limit
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    def try_acquire(self) -> bool:
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return True
        return False

    async def acquire(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a slot; False when none freed up in time."""
        if self.try_acquire():
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
            return True
        except TimeoutError:
            return waiter.done() and not waiter.cancelled()  # handed over just as the wait ran out
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over, but nobody will use it
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        """Give the slot to the longest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        if self.active <= 0:
            raise RuntimeError("released a slot that was never acquired")
        self.active -= 1
