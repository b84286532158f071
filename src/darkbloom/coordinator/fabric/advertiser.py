"""Announcing this replica's sessions: what changed, as it changes; all of them only when asked.

- **Deltas** on ``<prefix>.fleet``: the sessions that changed (their whole announcement) and the ones
  that left, coalesced (at most one burst per ``FLUSH_DELAY``), numbered ``seq`` 1, 2, … with no gap:
  a replica that misses one knows it did. Most changes are only load — a slot claimed or freed, two
  per request, and a new decode speed — and every other replica reads each delta, so a change of load
  alone waits up to ``LOAD_DELAY`` (50 ms: under load a quarter as many fleet messages as with 5 ms,
  bench/RESULTS.md), any other change (a session added, gone, its trust, owner or loaded models) at
  most ``FLUSH_DELAY``, so the others see a new session at once. A load that old is safe to route on:
  the holder checks each claim against the session as it is now (``holder.Holder._claim``) and
  refuses a busy one; a slot freed is seen up to 50 ms late, so another replica's choice may be that
  much out of date. A challenge passed again while the pass the others know is still fresh for
  longer than a heartbeat (every ``--challenge-interval``, 300 s, per session: at 10,000 sessions
  ~33 a second) leaves with the next heartbeat: one delta a second for all of them, not one each.
- **Alive** on ``<prefix>.fleet`` every ``--replica-heartbeat``: the number of the last delta and how
  many sessions this replica lists, so a replica that missed a delta or went wrong notices it and
  asks; a few dozen bytes however many sessions there are.
- **A full view** on ``<prefix>.view.<asker>``, only to a replica that asked (it joined, or it found
  itself out of step), in as many parts as the server's ``max_payload`` needs, and to each asking
  replica at most once per heartbeat (a later ask is answered when that time is up): asking costs
  the asker one small message, so no replica can make this one send views without bound.

The registry tells the advertiser of every change to a listed session (added, removed, disowned, a
field the views depend on, its active count, a passed challenge); other replicas' stand-ins are not
announced. A session whose announcement would not fit in one message is not announced at all, and
said so: no message on the bus exceeds ``max_payload``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession

log = logging.getLogger("darkbloom.fabric")
FLUSH_DELAY = 0.005  # seconds: changes within it leave together (a burst of registrations)
LOAD_DELAY = 0.05  # seconds a change of load alone may wait (see the module)



class Advertiser:
    def __init__(self, registry: Registry, connection: Connection, subjects: Subjects, heartbeat: float,
                 challenge_freshness: float) -> None:
        self.registry = registry
        self.connection = connection
        self.subjects = subjects
        self.heartbeat = heartbeat
        self.challenge_freshness = challenge_freshness
        self.seq = 0  # the number of the last delta (sent or, without a connection, lost)
        self.announced: dict[str, ProviderSession] = {}  # what the other replicas are told this one lists
        self._dirty: dict[str, ProviderSession] = {}
        self._facts: dict[str, tuple[object, ...]] = {}  # each announced session's facts, as announced
        self._flush_at: asyncio.TimerHandle | None = None
        self._views = itertools.count(1)
        self._answered_at: dict[str, float] = {}  # asking replica → when it was last sent a view
        self._answer_later: dict[str, asyncio.TimerHandle] = {}
        registry.listeners.append(self._changed)

    def _changed(self, session: ProviderSession) -> None:
        if session.id not in self.announced and not self._listed(session):
            return  # never announced and not announceable now: nothing to tell
        self._dirty[session.id] = session
        told, facts = self._facts.get(session.id), messages.facts_of(session)
        if (told is not None and told != facts  # (a change of load alone, the usual one, stops here)
                and messages.renewed_only(told, facts) and self._fresh_for_now(told)):
            return  # the next heartbeat flushes it
        loop = asyncio.get_running_loop()
        due = loop.time() + (LOAD_DELAY if told == facts else FLUSH_DELAY)
        if self._flush_at is not None and self._flush_at.when() <= due:
            return
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._flush_at = loop.call_at(due, self.flush)

    def _fresh_for_now(self, told: tuple[object, ...]) -> bool:
        """Whether the challenge pass the others were told of stays fresh for two heartbeats more."""
        passed_at = messages.passed_at(told)
        return passed_at is not None and time.monotonic() - passed_at < self.challenge_freshness - 2 * self.heartbeat

    def _listed(self, session: ProviderSession) -> bool:
        """Online here, and its chunks prove they come from its node (only then can they cross NATS)."""
        return (session.online and session.registration.authenticated_chunks
                and self.registry.get(session.id) is session)

    def flush(self) -> None:
        """Send the changes not sent yet, as deltas."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        dirty, self._dirty = self._dirty, {}
        room = self.connection.room
        changed: list[bytes] = []
        gone: list[str] = []
        for session in dirty.values():
            announced = messages.encoded(messages.announcement(session)) if self._listed(session) else None
            if announced is not None and not messages.fits(announced, room):
                log.error("session %s is not announced to the other replicas: its announcement (%d bytes) "
                          "does not fit in one NATS message (%d)", session.id, len(announced), room)
                announced = None
            if announced is not None:
                self.announced[session.id] = session
                self._facts[session.id] = messages.facts_of(session)
                changed.append(announced)
            else:
                self._facts.pop(session.id, None)
                if self.announced.pop(session.id, None) is not None:
                    gone.append(session.id)
        if not changed and not gone:
            return
        bodies = messages.deltas(self.subjects.replica, self.seq + 1, changed, gone, room)
        self.seq += len(bodies)  # numbered whether or not they leave: a receiver sees the gap either way
        for body in bodies:
            self.connection.post(self.subjects.fleet, body)

    def alive(self) -> None:
        self.flush()  # (the count and number it gives are those of what was sent)
        self.connection.post(self.subjects.fleet, messages.alive(self.subjects.replica, self.seq,
                                                                 len(self.announced)))

    def asked(self, replica: str) -> None:
        """``replica`` asks for the full view: now, or once a heartbeat has passed since its last one."""
        if replica in self._answer_later:
            return  # it is already coming
        wait = self._answered_at.get(replica, float("-inf")) + self.heartbeat - time.monotonic()
        if wait <= 0:
            self.send_view(replica)
        else:
            self._answer_later[replica] = asyncio.get_running_loop().call_later(wait, self.send_view, replica)

    def send_view(self, replica: str) -> None:
        self._answer_later.pop(replica, None)
        self._answered_at[replica] = time.monotonic()
        self.flush()  # the view is then exactly what deltas up to ``seq`` made
        sessions = [messages.encoded(messages.announcement(s)) for s in self.announced.values()]
        parts = messages.view(self.subjects.replica, self.seq, next(self._views), sessions, self.connection.room)
        for part in parts:
            if not self.connection.post(self.subjects.view(replica), part, replica):
                return  # it asks again

    def forget(self, replica: str) -> None:
        """A replica gone: no view owed to it any more."""
        self._answered_at.pop(replica, None)
        later = self._answer_later.pop(replica, None)
        if later is not None:
            later.cancel()

    def leaving(self) -> bytes:
        return messages.leaving(self.subjects.replica)

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                self.alive()
            except Exception:  # noqa: BLE001 - the next heartbeat tries again
                log.exception("the heartbeat of this replica failed")
