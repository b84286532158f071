"""Announcing this replica's sessions on ``<prefix>.fleet``: the sessions that changed, coalesced
(at most one message per ``FLUSH_DELAY``), and all of them every ``--replica-heartbeat`` — which is
also how the other replicas know this one is alive (an empty list is a heartbeat too).

The registry tells the announcer of every change to a listed session (added, removed, disowned, a
field the views depend on, its active count); other replicas' stand-ins are not announced.
"""

from __future__ import annotations

import asyncio
import logging

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession

log = logging.getLogger("darkbloom.fabric")
FLUSH_DELAY = 0.005  # seconds: changes within it leave in one message (a burst of claims and releases)


class Advertiser:
    def __init__(self, registry: Registry, connection: Connection, subjects: Subjects, heartbeat: float) -> None:
        self.registry = registry
        self.connection = connection
        self.subjects = subjects
        self.heartbeat = heartbeat
        self._dirty: dict[str, ProviderSession] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        registry.listeners.append(self._changed)
        connection.on_up(self.announce_all)

    def _changed(self, session: ProviderSession) -> None:
        self._dirty[session.id] = session
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._flush)

    def _listed(self, session: ProviderSession) -> bool:
        """Online here, and its chunks prove they come from its node (only then can they cross NATS)."""
        return (session.online and session.registration.authenticated_chunks
                and self.registry.get(session.id) is session)

    def _flush(self) -> None:
        self._flush_at = None
        dirty, self._dirty = self._dirty, {}
        changed = [messages.announcement(s) for s in dirty.values() if self._listed(s)]
        gone = [s.id for s in dirty.values() if s.registration.authenticated_chunks and not self._listed(s)]
        if changed or gone:
            self.connection.post(self.subjects.fleet,
                                 messages.fleet_message(self.subjects.replica, changed, gone, full=False))

    def announce_all(self) -> None:
        sessions = [messages.announcement(s) for s in self.registry.held_here() if self._listed(s)]
        self.connection.post(self.subjects.fleet,
                             messages.fleet_message(self.subjects.replica, sessions, [], full=True))

    def leaving(self) -> bytes:
        """The last message of a replica that stops: every other replica drops its sessions at once."""
        return messages.fleet_message(self.subjects.replica, [], [], full=True, leaving=True)

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                self.announce_all()
            except Exception:  # noqa: BLE001 - the next heartbeat tries again
                log.exception("announcing this replica's sessions failed")
