"""MachineBook: the machines table's live columns (last seen, models, trust, private_only, name,
identity key), written in batches rather than a transaction per session per event.

Callers ``mark`` a machine with what its session now says; marks coalesce per machine (the latest
wins). A ``Flusher`` (``fleet/flusher.py``) writes every marked machine in ONE transaction at most
every ``machine_flush_interval`` seconds, and ``close`` writes what is left. A batch that fails is
logged and kept for the next round (a newer mark of the same machine wins over it), so nothing is
lost and no socket ever waits on the database.

Readers on this replica see the rows as they will be: ``current`` lays what is marked and not yet
committed over a stored row (another replica's readers see it once the batch commits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.flusher import Flusher
from darkbloom.store import machines
from darkbloom.store.machines import Seen

log = logging.getLogger("darkbloom.machines")


class MachineBook:
    def __init__(self, engine: AsyncEngine | None, interval: float) -> None:
        self._engine = engine
        self._dirty: dict[str, Seen] = {}
        self._writing: dict[str, Seen] = {}  # the batch being committed
        self._lock = asyncio.Lock()  # one batch at a time: an older one never lands after a newer one
        self._marked = asyncio.Event()
        self._flusher = Flusher("machine-book", self.flush, interval, log=log, wake=self._marked,
                                what=lambda: f"{len(self._dirty)} machines")
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
        self._flusher.start()

    async def close(self) -> None:
        """Stop the flusher and write what is still marked."""
        await self._flusher.close()

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
