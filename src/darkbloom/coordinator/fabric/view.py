"""The other replicas' sessions, kept in this replica's registry as stand-ins: sessions whose link
(``fabric.remote_link.RemoteLink``) goes to the replica holding them.

Each other replica is ``Heard`` here: when it was last heard, and the number of its last delta this
view reflects (``seq``, None until it is in step). A full view of it (``view`` parts, on
``<prefix>.view.<this>``) puts this view in step at the view's ``seq``; from then on its deltas apply
in order. This replica asks a replica for its view (``sync``) when it hears one it does not know, a
delta after a gap, an ``alive`` naming a delta it never got, or (in two heartbeats running) a count
of sessions that is not the number of stand-ins it has of that replica — and asks again every ``--replica-timeout`` until a view
comes. While it waits, deltas are kept (up to ``MAX_WAITING`` sessions in them) and applied after
the view.

A replica silent for ``--replica-timeout`` — killed, partitioned, or this replica's NATS connection
is down — is gone: its stand-ins leave the registry, the attempts placed on them fail as a
disconnected provider's do (retried before first content, the in-band error after it), and the
requests it had placed here are cancelled (``on_replica_gone``).

A stand-in only moves the way a real session can: it loses its owner (unlink) but never gains one,
starts draining or becomes untrusted but never stops; an announcement sent before such a change
cannot undo it here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client import Gauge

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Opened, refuse
from darkbloom.coordinator.fabric.remote_link import Outbound, RemoteLink
from darkbloom.coordinator.fleet import slots
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import DecryptionError, public_key_from_b64

log = logging.getLogger("darkbloom.fabric")
REPLICAS = Gauge("darkbloom_fabric_replicas", "Other coordinator replicas this one hears over NATS")
REMOTE_SESSIONS = Gauge("darkbloom_fabric_remote_sessions", "Provider sessions held by other replicas")
UNSYNCED = Gauge("darkbloom_fabric_unsynced_replicas",
                 "Replicas this one hears but whose sessions it does not see in full (waiting for their view)")
MAX_WAITING = 10_000  # sessions in the deltas kept per replica while its view comes; beyond, it is asked again
MAX_PARTS = 100_000  # parts of one view (each holds at least one session)
CHALLENGE_AGE_SLACK = 1.0  # seconds: a challenge time read from an age moves only when it really changed


@dataclass
class Heard:
    """Another replica, as this one follows it."""

    replica: str
    heard_at: float
    seq: int | None = None  # its last delta reflected here; None: not in step (waiting for a view)
    applied: int = 0  # the newest of its deltas (or views) applied here: an older view is stale
    sessions: set[str] = field(default_factory=set)  # its sessions that have stand-ins here
    waiting: dict[int, dict[str, Any]] = field(default_factory=dict)  # deltas received while not in step
    waiting_items: int = 0  # sessions and gone ids in them
    asked_at: float = float("-inf")
    miscounted: bool = False  # its last heartbeat's count was not what this replica has of it
    view: int | None = None  # the view whose parts are arriving
    parts_seen: set[int] = field(default_factory=set)
    listed: set[str] = field(default_factory=set)  # sessions the arriving view listed so far


class FleetView:
    def __init__(self, services: Services, outbound: Outbound, on_replica_gone: Callable[[str], None]) -> None:
        self.services = services
        self.registry = services.registry
        self.outbound = outbound
        self.connection = outbound.connection
        self.subjects = outbound.subjects
        self.me = outbound.subjects.replica
        self.on_replica_gone = on_replica_gone
        self.heard: dict[str, Heard] = {}
        self.links: dict[str, RemoteLink] = {}  # session id → the link of its stand-in
        self.on_sync_asked: Callable[[str], None] = lambda _replica: None  # (the advertiser's ``asked``)
        self.on_forget: Callable[[str], None] = lambda _replica: None
        self._asked_everyone_at = float("-inf")

    @property
    def unsynced(self) -> list[str]:
        return sorted(replica for replica, heard in self.heard.items() if heard.seq is None)

    # what arrives

    async def on_message(self, opened: Opened, msg: Any) -> None:
        """On ``<prefix>.fleet``: deltas, alive, sync (of everyone), leaving."""
        try:
            self.apply(opened.sender, messages.json_object(opened.body))
        except Exception:  # noqa: BLE001 - one bad message never stops the subscription
            log.exception("bad fleet message from %s", opened.sender)

    async def on_direct(self, opened: Opened, msg: Any) -> None:
        """On ``<prefix>.view.<this>``: a sync asked of this replica, or a part of a view it asked for."""
        try:
            self.apply(opened.sender, messages.json_object(opened.body))
        except Exception:  # noqa: BLE001
            log.exception("bad view message from %s", opened.sender)

    def apply(self, sender: str, body: dict[str, Any]) -> None:
        """A replica's message about itself (``sender`` is proven; it speaks for itself only)."""
        replica = body["replica"]
        if replica != sender:
            refuse("impersonation", "replica %s spoke for replica %s", sender, replica)
            return
        if replica == self.me:
            return
        kind = body["k"]
        if kind == "sync":
            self.on_sync_asked(replica)
            return
        if kind == "leaving":
            self.replica_gone(replica, "it stopped")
            return
        heard = self._hear(replica)
        if kind == "alive":
            self._alive(heard, int(body["seq"]), int(body["count"]))
        elif kind == "delta":
            self._delta(heard, int(body["seq"]), body)
        elif kind == "view":
            self._view_part(heard, body)
        self._count()

    def _hear(self, replica: str) -> Heard:
        now = time.monotonic()
        heard = self.heard.get(replica)
        if heard is None:
            # (its view is on its way if this replica asked everyone lately)
            heard = self.heard[replica] = Heard(replica, now, asked_at=self._asked_everyone_at)
            log.info("hearing replica %s", replica)
        heard.heard_at = now
        return heard

    def _alive(self, heard: Heard, seq: int, count: int) -> None:
        miscounted = count != len(heard.sessions)
        if heard.seq is None and seq == 0 and count == 0 and not heard.sessions:
            heard.seq = 0  # nothing announced yet: nothing to ask for
        elif heard.seq is not None and (seq != heard.seq or miscounted and heard.miscounted):
            # (a count that differs once may be a stand-in dropped here on a "gone" answer that the
            # holder's delta has not reached yet; twice running, something was lost)
            log.warning("out of step with replica %s (its delta %d, %d sessions; here %d, %d): asking for its view",
                        heard.replica, seq, count, heard.seq, len(heard.sessions))
            self._out_of_step(heard)
        heard.miscounted = miscounted and heard.seq is not None
        if heard.seq is None:
            self._ask(heard)

    def _delta(self, heard: Heard, seq: int, body: dict[str, Any]) -> None:
        if heard.seq is None and seq == 1 and not heard.sessions:
            heard.seq = 0  # its first delta: nothing came before
        if heard.seq is None:
            self._wait(heard, seq, body)
        elif seq <= heard.seq:
            return  # already in the view it sent
        elif seq == heard.seq + 1:
            self._apply_delta(heard, body)
            heard.seq = heard.applied = seq
        else:
            log.warning("missed deltas %d to %d of replica %s: asking for its view", heard.seq + 1, seq - 1,
                        heard.replica)
            self._out_of_step(heard)
            self._wait(heard, seq, body)
            self._ask(heard)

    def _wait(self, heard: Heard, seq: int, body: dict[str, Any]) -> None:
        items = len(body["sessions"]) + len(body["gone"])
        if heard.waiting_items + items > MAX_WAITING:
            heard.waiting.clear()  # the view will be older than what follows: a gap, and another ask
            heard.waiting_items = 0
        heard.waiting[seq] = body
        heard.waiting_items += items

    def _out_of_step(self, heard: Heard) -> None:
        heard.seq = None
        heard.asked_at = float("-inf")

    def _apply_delta(self, heard: Heard, body: dict[str, Any]) -> None:
        for announced in body["sessions"]:
            self._upsert(heard, announced)
        for session_id in body["gone"]:
            self._drop_of(heard, session_id)
        self.services.queues.drain()  # a slot freed anywhere may place a waiter here

    def _view_part(self, heard: Heard, body: dict[str, Any]) -> None:
        """Parts apply as they come (they are as new as anything this replica has of it, or newer);
        once all are in, what the view did not list is gone, and the deltas kept meanwhile follow."""
        seq, number, part, parts = int(body["seq"]), int(body["view"]), int(body["part"]), int(body["parts"])
        if heard.seq is not None or seq < heard.applied or not 0 <= part < parts <= MAX_PARTS:
            return  # in step already (an answer to an ask it no longer needs), older than that, or nonsense
        if heard.view != number:
            heard.view, heard.parts_seen, heard.listed = number, set(), set()
        if part in heard.parts_seen:
            return
        heard.parts_seen.add(part)
        for announced in body["sessions"]:
            if self._upsert(heard, announced):
                heard.listed.add(announced["id"])
        if len(heard.parts_seen) < parts:
            return
        for session_id in heard.sessions - heard.listed:
            self._drop_of(heard, session_id)
        heard.view, heard.parts_seen, heard.listed = None, set(), set()
        heard.seq = heard.applied = seq
        waiting, heard.waiting, heard.waiting_items = heard.waiting, {}, 0
        for next_seq in sorted(waiting):
            if next_seq <= heard.seq:
                continue
            if next_seq != heard.seq + 1:
                log.warning("replica %s: deltas %d to %d lost while its view came: asking again", heard.replica,
                            heard.seq + 1, next_seq - 1)
                heard.seq = None
                heard.waiting = {s: waiting[s] for s in waiting if s >= next_seq}
                heard.waiting_items = sum(len(d["sessions"]) + len(d["gone"]) for d in heard.waiting.values())
                self._ask(heard)
                break
            self._apply_delta(heard, waiting[next_seq])
            heard.seq = heard.applied = next_seq
        log.info("in step with replica %s at its delta %s: %d of its sessions", heard.replica, heard.seq,
                 len(heard.sessions))
        self.services.queues.drain()

    # asking

    def ask_everyone(self) -> None:
        """This replica (re)joined: every other replica sends it its view (they answer on the fleet's ask)."""
        self._asked_everyone_at = time.monotonic()
        for heard in self.heard.values():
            heard.seq, heard.asked_at = None, self._asked_everyone_at
        self.connection.post(self.subjects.fleet, messages.sync_request(self.me))

    def _ask(self, heard: Heard) -> None:
        """Ask ``heard`` for its view, unless that was asked within ``--replica-timeout``."""
        now = time.monotonic()
        if now - heard.asked_at < self.services.settings.replica_timeout:
            return
        heard.asked_at = now
        self.connection.post(self.subjects.view(heard.replica), messages.sync_request(self.me), heard.replica)

    # the stand-ins

    def _upsert(self, heard: Heard, announced: dict[str, Any]) -> bool:
        """Add or update the stand-in of a session ``heard`` holds; False when it may not speak for it."""
        now = time.monotonic()
        replica = heard.replica
        link = self.links.get(announced["id"])
        if link is not None and link.holder != replica or (
                link is None and self.registry.get(announced["id"]) is not None):
            # another replica's session, or one of ours
            refuse("impersonation", "replica %s announced session %s, which it does not hold", replica, announced["id"])
            return False
        if link is None:
            link = self._stand_in(replica, announced, now)
            self.links[link.session.id] = link
            heard.sessions.add(link.session.id)
            self.registry.add_stand_in(link.session)
            return True
        stand_in = link.session
        link.announced_active = int(announced["active"])
        _update(stand_in, announced, now)
        if announced["account_id"] is None and stand_in.account_id is not None:
            stand_in.disown()
        return True

    def _stand_in(self, replica: str, announced: dict[str, Any], now: float) -> RemoteLink:
        try:
            public_key = public_key_from_b64(announced["public_key"]) if announced["public_key"] else None
        except DecryptionError:
            public_key = None
        link = RemoteLink(replica, self.outbound)
        link.announced_active = int(announced["active"])
        stand_in = link.session = ProviderSession(
            id=announced["id"], account_id=announced["account_id"], machine_id=announced["machine_id"],
            registration=messages.registration_of(announced), public_key=public_key, link=link,
            trust_level=announced["trust_level"], runtime_verified=bool(announced["runtime_verified"]),
            connected_at=now - float(announced["connected_age"]),
            last_frame_at=float("inf"))  # never evicted here: its replica's silence removes it
        _update(stand_in, announced, now)
        stand_in.mark_online()
        return link

    def _drop_of(self, heard: Heard, session_id: str) -> None:
        link = self.links.get(session_id)
        if link is not None and link.holder == heard.replica:
            self.drop(session_id)

    def drop(self, session_id: str) -> None:
        link = self.links.pop(session_id, None)
        if link is None:
            return
        heard = self.heard.get(link.holder)
        if heard is not None:
            heard.sessions.discard(session_id)
        self.registry.remove(link.session)
        link.session.disconnected()

    def replica_gone(self, replica: str, why: str) -> None:
        heard = self.heard.pop(replica, None)
        dropped = [sid for sid, link in self.links.items() if link.holder == replica]
        for session_id in dropped:
            self.drop(session_id)
        if heard is not None or dropped:
            log.warning("replica %s is gone (%s): %d of its sessions dropped", replica, why, len(dropped))
        self.on_forget(replica)
        self.on_replica_gone(replica)
        self._count()

    async def watch_forever(self) -> None:
        """Wakes when the replica heard least lately would be silent too long (with none: every timeout)."""
        settings = self.services.settings
        while True:
            oldest = min((heard.heard_at for heard in self.heard.values()), default=time.monotonic())
            await asyncio.sleep(max(oldest + settings.replica_timeout - time.monotonic(), 0) + 0.01)
            deadline = time.monotonic() - settings.replica_timeout
            for replica, heard in list(self.heard.items()):
                if heard.heard_at < deadline:
                    try:
                        self.replica_gone(replica, f"silent for {settings.replica_timeout:g} s")
                    except Exception:  # noqa: BLE001 - the watch goes on
                        log.exception("dropping replica %s failed", replica)

    def _count(self) -> None:
        REPLICAS.set(len(self.heard))
        REMOTE_SESSIONS.set(len(self.links))
        UNSYNCED.set(sum(1 for heard in self.heard.values() if heard.seq is None))


def _update(stand_in: ProviderSession, announced: dict[str, Any], now: float) -> None:
    """The holder's current facts; the one-way ones (untrusted, draining) only ever set. (Its runtime's
    verification never changes on its holder: the stand-in is made with it.)"""
    age = announced["challenge_age"]
    passed = None if age is None else now - float(age)
    known = stand_in.challenge_passed_at
    if passed is None or known is None or abs(passed - known) > CHALLENGE_AGE_SLACK:
        if passed != known:
            stand_in.record_challenge_pass(passed)
    if stand_in.trust_level != announced["trust_level"]:
        stand_in.raise_trust(announced["trust_level"])
    if announced["untrusted_reason"]:
        stand_in.distrusted_elsewhere(announced["untrusted_reason"])
    if announced["draining"]:
        stand_in.start_draining()
    stand_in.report_loaded(messages.loaded_of(announced, stand_in.registration.models))
    if stand_in.decode_tps != announced["decode_tps"]:
        stand_in.report_speed(float(announced["decode_tps"]))
    if stand_in.active != announced["active"]:
        slots.mirror(stand_in, int(announced["active"]))
