"""Flusher: a batch write repeated every ``interval`` seconds, and a last one when the process stops.

The machine book and the machine insight (``fleet/machine_book.py``, ``fleet/insight.py``) keep what
they learn in memory and add it to the database in batches; this is the one way both do it. Each
round's write runs as a task of its own behind ``asyncio.shield``: stopping the flusher never cancels a
transaction mid-statement (asyncpg can then leave it open on the server, holding the rows the last
write at shutdown waits for). ``close`` lets a write under way end — one stuck past ``patience``
seconds is cancelled, so stopping stays bounded — then writes once more. A write that fails is logged;
what it carried is the owner's to keep for the next round.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable


class Flusher:
    def __init__(self, name: str, write: Callable[[], Awaitable[None]], interval: float, *,
                 log: logging.Logger, what: Callable[[], str],
                 last_write: Callable[[], Awaitable[None]] | None = None,
                 wake: asyncio.Event | None = None, patience: float = 30.0) -> None:
        """``write`` each round and ``last_write`` (default ``write``) at ``close``; ``what`` names what
        a failed write held, for the log; with ``wake``, a round waits for it to be set first (and
        clears it), so nothing runs while there is nothing to write."""
        self.name = name
        self.interval = interval
        self.patience = patience
        self._write = write
        self._last_write = last_write or write
        self._log = log
        self._what = what
        self._wake = wake
        self._task: asyncio.Task[None] | None = None
        self._round: asyncio.Future[None] | None = None  # the round's write last started

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def close(self) -> None:
        """Stop the rounds, let a write under way end, and write once more (a failure is logged:
        nothing is left to retry it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._round is not None and not (await asyncio.wait({self._round}, timeout=self.patience))[0]:
            self._round.cancel()
            await asyncio.gather(self._round, return_exceptions=True)
        try:
            await self._last_write()
        except Exception:  # noqa: BLE001 - the process is stopping; say what is lost
            self._log.exception("could not record %s at shutdown", self._what())

    async def _run(self) -> None:
        while True:
            if self._wake is not None:
                await self._wake.wait()
            await asyncio.sleep(self.interval)
            if self._wake is not None:
                self._wake.clear()
            self._round = asyncio.ensure_future(self._flush_round())
            await asyncio.shield(self._round)

    async def _flush_round(self) -> None:
        try:
            await self._write()
        except Exception as exc:  # noqa: BLE001 - the owner kept it; the next round retries
            self._log.warning("could not record %s (%r); retrying in %g s", self._what(), exc, self.interval)
