"""A database write that waits until the test lets it go: what a flusher's stop meets mid-write."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


class HeldWrite:
    """Stands in for ``write``: each call says it ``entered``, waits for ``release``, then writes.
    ``outcomes`` records "done" or "cancelled" per call."""

    def __init__(self, write: Callable[..., Awaitable[Any]]) -> None:
        self._write = write
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.outcomes: list[str] = []

    async def __call__(self, *args: Any) -> None:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.outcomes.append("cancelled")
            raise
        await self._write(*args)
        self.outcomes.append("done")
