"""The other replicas' sessions, kept in this replica's registry as stand-ins: sessions whose link
(``fabric.remote_link.RemoteLink``) goes to the replica holding them.

Every announcement on ``<prefix>.fleet`` from another replica adds or updates its stand-ins (a full
one also drops those it no longer lists). A replica silent for ``--replica-timeout`` — killed,
partitioned, or this replica's NATS connection is down — is gone: its stand-ins leave the registry,
the attempts placed on them fail as a disconnected provider's do (retried before first content, the
in-band error after it), and the requests it had placed here are cancelled (``on_replica_gone``).

A stand-in only moves the way a real session can: it loses its owner (unlink) but never gains one,
starts draining or becomes untrusted but never stops; an announcement sent before such a change
cannot undo it here.
"""

from __future__ import annotations

import asyncio
import logging
import time
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


class FleetView:
    def __init__(self, services: Services, outbound: Outbound, on_replica_gone: Callable[[str], None]) -> None:
        self.services = services
        self.registry = services.registry
        self.outbound = outbound
        self.me = outbound.subjects.replica
        self.on_replica_gone = on_replica_gone
        self.heard: dict[str, float] = {}  # replica → when it was last heard (monotonic, here)
        self.links: dict[str, RemoteLink] = {}  # session id → the link of its stand-in

    async def on_message(self, opened: Opened, msg: Any) -> None:
        try:
            self.apply(opened.sender, messages.json_object(opened.body))
        except Exception:  # noqa: BLE001 - one bad announcement never stops the subscription
            log.exception("bad fleet announcement from %s", opened.sender)

    def apply(self, sender: str, body: dict[str, Any]) -> None:
        """A replica's announcement of its own sessions (``sender`` is proven; it speaks for itself only)."""
        replica = body["replica"]
        if replica != sender:
            refuse("impersonation", "replica %s announced for replica %s", sender, replica)
            return
        if replica == self.me:
            return
        if body.get("leaving"):
            self.replica_gone(replica, "it stopped")
            return
        self.heard[replica] = time.monotonic()
        for announced in body["sessions"]:
            self._upsert(replica, announced)
        gone = set(body["gone"])
        if body["full"]:
            listed = {announced["id"] for announced in body["sessions"]}
            gone |= {sid for sid, link in self.links.items() if link.holder == replica and sid not in listed}
        for session_id in gone:
            link = self.links.get(session_id)
            if link is not None and link.holder == replica:
                self.drop(session_id)
        self._count()
        self.services.queues.drain()  # a slot freed anywhere may place a waiter here

    def _upsert(self, replica: str, announced: dict[str, Any]) -> None:
        now = time.monotonic()
        link = self.links.get(announced["id"])
        if link is not None and link.holder != replica or (
                link is None and self.registry.get(announced["id"]) is not None):
            # another replica's session, or one of ours
            refuse("impersonation", "replica %s announced session %s, which it does not hold", replica, announced["id"])
            return
        if link is None:
            link = self._stand_in(replica, announced, now)
            self.links[link.session.id] = link
            self.registry.add_stand_in(link.session)
            return
        stand_in = link.session
        _update(stand_in, announced, now)
        if announced["account_id"] is None and stand_in.account_id is not None:
            self.registry.disown(stand_in)

    def _stand_in(self, replica: str, announced: dict[str, Any], now: float) -> RemoteLink:
        try:
            public_key = public_key_from_b64(announced["public_key"]) if announced["public_key"] else None
        except DecryptionError:
            public_key = None
        link = RemoteLink(replica, self.outbound)
        stand_in = link.session = ProviderSession(
            id=announced["id"], account_id=announced["account_id"], machine_id=announced["machine_id"],
            registration=messages.registration_of(announced), public_key=public_key, link=link)
        stand_in.connected_at = now - float(announced["connected_age"])
        stand_in.last_frame_at = float("inf")  # never evicted here: its replica's silence removes it
        _update(stand_in, announced, now)
        stand_in.online = True
        return link

    def drop(self, session_id: str) -> None:
        link = self.links.pop(session_id, None)
        if link is None:
            return
        self.registry.remove(link.session)
        link.session.disconnected()

    def replica_gone(self, replica: str, why: str) -> None:
        heard = self.heard.pop(replica, None) is not None
        dropped = [sid for sid, link in self.links.items() if link.holder == replica]
        for session_id in dropped:
            self.drop(session_id)
        if heard or dropped:
            log.warning("replica %s is gone (%s): %d of its sessions dropped", replica, why, len(dropped))
        self.on_replica_gone(replica)
        self._count()

    async def watch_forever(self) -> None:
        settings = self.services.settings
        while True:
            await asyncio.sleep(settings.replica_heartbeat / 2)
            deadline = time.monotonic() - settings.replica_timeout
            for replica, heard in list(self.heard.items()):
                if heard < deadline:
                    try:
                        self.replica_gone(replica, f"silent for {settings.replica_timeout:g} s")
                    except Exception:  # noqa: BLE001 - the watch goes on
                        log.exception("dropping replica %s failed", replica)

    def _count(self) -> None:
        REPLICAS.set(len(self.heard))
        REMOTE_SESSIONS.set(len(self.links))


def _update(stand_in: ProviderSession, announced: dict[str, Any], now: float) -> None:
    """The holder's current facts; the one-way ones (untrusted, draining) only ever set."""
    age = announced["challenge_age"]
    stand_in.challenge_passed_at = None if age is None else now - float(age)
    if stand_in.trust_level != announced["trust_level"]:
        stand_in.trust_level = announced["trust_level"]
    if stand_in.runtime_verified != announced["runtime_verified"]:
        stand_in.runtime_verified = bool(announced["runtime_verified"])
    if announced["untrusted_reason"] and stand_in.untrusted_reason is None:
        stand_in.untrusted_reason = announced["untrusted_reason"]
    if announced["draining"] and not stand_in.draining:
        stand_in.draining = True
    if stand_in.decode_tps != announced["decode_tps"]:
        stand_in.decode_tps = float(announced["decode_tps"])
    if stand_in.active != announced["active"]:
        slots.mirror(stand_in, int(announced["active"]))
