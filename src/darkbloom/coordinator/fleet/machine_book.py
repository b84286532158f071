"""MachineBook: the machines table's live columns (last seen, models, trust, private_only, name,
identity key), written in batches rather than a transaction per session per event.

Callers ``mark`` a machine with what its session now says; marks coalesce per machine (the latest
wins). One task writes every marked machine in ONE transaction at most every
``machine_flush_interval`` seconds, and ``close`` writes what is left. A batch that fails is logged
and kept for the next round (a newer mark of the same machine wins over it), so nothing is lost
and no socket ever waits on the database.

Readers on this replica see the rows as they will be: ``current`` lays what is marked and not yet
committed over a stored row (another replica's readers see it once the batch commits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store import machines
from darkbloom.store.machines import Seen

log = logging.getLogger("darkbloom.machines")


async def finish_write(write: asyncio.Future[None], patience: float = 30.0) -> None:
    """Let a flusher's write under way end (see ``MachineBook._run``); one stuck past ``patience``
    seconds is cancelled, so stopping stays bounded. The machine insight's flusher stops the same way."""
    if not (await asyncio.wait({write}, timeout=patience))[0]:
        write.cancel()
        await asyncio.gather(write, return_exceptions=True)


class MachineBook:
    def __init__(self, engine: AsyncEngine | None, interval: float) -> None:
        self._engine = engine
        self.interval = interval
        self._dirty: dict[str, Seen] = {}
        self._writing: dict[str, Seen] = {}  # the batch being committed
        self._lock = asyncio.Lock()  # one batch at a time: an older one never lands after a newer one
        self._marked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._round: asyncio.Future[None] | None = None  # the periodic write last started
        self.flushes = 0  # committed batches and the rows they carried
        self.rows = 0

    def mark(self, machine_id: str, seen: Seen) -> None:
        self._dirty[machine_id] = seen
        self._marked.set()

    def pending(self, machine_id: str) -> Seen | None:
        """What is marked for the machine and not committed yet (None: the row is current)."""
        return self._dirty.get(machine_id) or self._writing.get(machine_id)

    def current(self, row: dict[str, Any]) -> dict[str, Any]:
        """A stored machines row with what is marked for it and not committed yet laid over it."""
        seen = self.pending(row["id"])
        if seen is None:
            return row
        return {**row, "last_seen": seen.last_seen, "models": seen.models, "trust_level": seen.trust_level,
                "private_only": seen.private_only, "name": seen.name or row["name"],
                "identity_key": seen.identity_key or row["identity_key"]}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="machine-book")

    async def close(self) -> None:
        """Stop the flusher and write what is still marked (a failure is logged: nothing to retry on)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._round is not None:  # a write under way ends as it would have (see _run)
            await finish_write(self._round)
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - the process is stopping; say what is lost
            log.exception("could not record %d machines at shutdown", len(self._dirty))

    async def flush(self) -> None:
        """Write everything marked so far in one transaction; on failure it stays marked and this raises."""
        async with self._lock:
            if not self._dirty:
                return
            if self._engine is None:
                raise RuntimeError("no database: these services were built without an engine")
            batch, self._dirty, self._writing = self._dirty, {}, self._dirty
            try:
                async with self._engine.begin() as conn:
                    await machines.record_seen(conn, batch)
            except BaseException:
                for machine_id, seen in batch.items():
                    self._dirty.setdefault(machine_id, seen)
                self._marked.set()
                raise
            finally:
                self._writing = {}
            self.flushes += 1
            self.rows += len(batch)

    async def _run(self) -> None:
        """Each round's write runs as a task of its own, shielded: stopping the flusher never cancels a
        transaction mid-statement (asyncpg can then leave it open on the server, holding the rows the
        last write at shutdown waits for)."""
        while True:
            await self._marked.wait()
            await asyncio.sleep(self.interval)
            self._marked.clear()
            self._round = asyncio.ensure_future(self._flush_round())
            await asyncio.shield(self._round)

    async def _flush_round(self) -> None:
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - kept marked; the next round retries it
            log.warning("could not record %d machines (%r); retrying in %g s", len(self._dirty), exc,
                        self.interval)
