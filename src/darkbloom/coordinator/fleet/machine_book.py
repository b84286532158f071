"""MachineBook: the machines table's live columns (last seen, models, trust, private_only, name,
identity key), written in batches rather than a transaction per session per event.

Callers ``mark`` a machine with what its session now says, or only ``touch`` its last seen time when
nothing else changed since the session's last mark (a connected machine is marked once a minute);
marks coalesce per machine (the latest wins; a touch only moves a pending mark's time). A
``Flusher`` (``fleet/flusher.py``) writes every marked and touched machine in ONE transaction at most
every ``machine_flush_interval`` seconds, and ``close`` writes what is left. A batch that fails is
logged and kept for the next round (a newer mark of the same machine wins over it), so nothing is
lost and no socket ever waits on the database.

Readers on this replica see the rows as they will be: ``current`` lays what is marked and not yet
committed over a stored row (another replica's readers see it once the batch commits).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
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
        self._touched: dict[str, int] = {}  # machine → last seen, for machines with no mark in _dirty
        self._writing: dict[str, Seen] = {}  # the batch being committed
        self._writing_touched: dict[str, int] = {}
        self._lock = asyncio.Lock()  # one batch at a time: an older one never lands after a newer one
        self._marked = asyncio.Event()
        self._flusher = Flusher("machine-book", self.flush, interval, log=log, wake=self._marked,
                                what=lambda: f"{len(self._dirty) + len(self._touched)} machines")
        self.flushes = 0  # committed batches and the rows they carried
        self.rows = 0

    def mark(self, machine_id: str, seen: Seen) -> None:
        self._dirty[machine_id] = seen
        self._touched.pop(machine_id, None)
        self._marked.set()

    def touch(self, machine_id: str, last_seen: int) -> None:
        """The machine was seen at ``last_seen`` and says nothing new (written as that column alone)."""
        marked = self._dirty.get(machine_id)
        if marked is not None:
            self._dirty[machine_id] = replace(marked, last_seen=last_seen)
        else:
            self._touched[machine_id] = last_seen
        self._marked.set()

    def pending(self, machine_id: str) -> bool:
        """Whether something of the machine is marked or touched and not committed yet."""
        return any(machine_id in held for held in (self._dirty, self._writing, self._touched, self._writing_touched))

    def current(self, row: dict[str, Any]) -> dict[str, Any]:
        """A stored machines row with what is marked for it and not committed yet laid over it."""
        machine_id = row["id"]
        seen = self._dirty.get(machine_id) or self._writing.get(machine_id)
        if seen is not None:
            row = {**row, "last_seen": seen.last_seen, "models": seen.models, "trust_level": seen.trust_level,
                   "private_only": seen.private_only, "name": seen.name or row["name"],
                   "identity_key": seen.identity_key or row["identity_key"]}
        if machine_id not in self._dirty:  # else a touch went into that mark; a touch now is newer than a write
            last_seen = self._touched.get(machine_id) or self._writing_touched.get(machine_id)
            if last_seen is not None:
                row = {**row, "last_seen": last_seen}
        return row

    def start(self) -> None:
        self._flusher.start()

    async def close(self) -> None:
        """Stop the flusher and write what is still marked."""
        await self._flusher.close()

    async def flush(self) -> None:
        """Write everything marked so far in one transaction; on failure it stays marked and this raises."""
        async with self._lock:
            if not self._dirty and not self._touched:
                return
            if self._engine is None:
                raise RuntimeError("no database: these services were built without an engine")
            batch, self._dirty, self._writing = self._dirty, {}, self._dirty
            touched, self._touched, self._writing_touched = self._touched, {}, self._touched
            try:
                async with self._engine.begin() as conn:
                    await machines.record_seen(conn, batch)
                    await machines.record_last_seen(conn, touched)
            except BaseException:
                for machine_id, seen in batch.items():
                    if machine_id not in self._dirty:  # else a newer mark wins; a newer touch moves its time
                        last_seen = self._touched.pop(machine_id, None)
                        self._dirty[machine_id] = seen if last_seen is None else replace(seen, last_seen=last_seen)
                for machine_id, last_seen in touched.items():
                    if machine_id not in self._dirty:  # a newer mark carries a newer time
                        self._touched.setdefault(machine_id, last_seen)
                self._marked.set()
                raise
            finally:
                self._writing, self._writing_touched = {}, {}
            self.flushes += 1
            self.rows += len(batch) + len(touched)
