"""The admitting side of remote dispatch: requests this replica places on other replicas' sessions.

A slot claimed on a stand-in has a ticket. ``confirm`` claims it on the holder (request/reply on
``claim.<holder>``); ``send_request`` passes the sealed frame (in parts when it is bigger than the
server's ``max_payload``) on ``hold.<holder>``, which also claims an unconfirmed ticket (a retry or
a backup, placed without waiting); ``send_frame`` passes a cancel or a trust status; ``released``
tells the holder the attempt is over. The holder's answers arrive on ``back.<this>.<ticket>`` and
feed the attempt's ``PendingRequest`` exactly as the provider's socket frames feed a local one,
including the checks that make a provider untrusted (the chunks open only here).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Opened, refuse
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fleet import session_lifecycle, slots
from darkbloom.wire.protocol import Envelope, Usage

if TYPE_CHECKING:
    from darkbloom.coordinator.fabric.remote_session import RemoteSession
    from darkbloom.coordinator.fleet.pending import PendingRequest
    from darkbloom.coordinator.fleet.registry import Registry
    from darkbloom.coordinator.fleet.slots import Slot

log = logging.getLogger("darkbloom.fabric")
CLAIM_TIMEOUT = 2.0  # seconds for the holder to answer a claim; after it, the slot counts as busy


class Outbound:
    def __init__(self, connection: Connection, subjects: Subjects, registry: "Registry") -> None:
        self.connection = connection
        self.subjects = subjects
        self.registry = registry
        self._attempts: dict[str, "PendingRequest"] = {}  # ticket → the attempt its frames feed
        self._known: set[str] = set()                     # tickets the holder may have claimed
        # the holder says the session is gone: drop its stand-in now (set by the Fabric to the view's
        # drop), so a retry or the Self-Route pre-flight sees at once what a local disconnect shows
        self.on_session_gone: Callable[[str], None] = lambda _session_id: None

    async def confirm(self, session: "RemoteSession", slot: "Slot") -> bool:
        assert slot.ticket is not None
        self._known.add(slot.ticket)
        reply = await self.connection.request(self.subjects.claim(session.holder),
                                              messages.claim_request(session.id, slot.ticket, self.subjects.replica),
                                              session.holder, CLAIM_TIMEOUT)
        try:
            answer = messages.json_object(reply.body) if reply is not None else {"ok": False, "why": "no answer"}
        except ValueError:
            answer = {"ok": False, "why": "a malformed answer"}
        if answer.get("ok"):
            return True
        log.info("replica %s refused a slot on %s: %s", session.holder, session.id, answer.get("why"))
        self._looks_full(session)
        return False

    def send_request(self, session: "RemoteSession", pending: "PendingRequest", frame_json: str) -> None:
        ticket = pending.slot.ticket
        assert ticket is not None
        self._attempts[ticket] = pending
        self._known.add(ticket)
        for part in messages.hold_parts("request", frame_json.encode(), self.connection.max_payload, t=ticket,
                                        s=session.id, r=pending.request_id, f=self.subjects.replica):
            self.connection.post(self.subjects.hold(session.holder), part, session.holder)

    def send_frame(self, session: "RemoteSession", frame_json: str) -> None:
        """A cancel (for the attempt of its request id) or a trust status, for the holder to apply."""
        kind = json.loads(frame_json).get("type")
        header: dict[str, Any] = {"s": session.id, "f": self.subjects.replica}
        if kind == "cancel":
            pending = session.pending.get(json.loads(frame_json)["request_id"])
            if pending is None or pending.slot.ticket is None:
                return
            header["t"] = pending.slot.ticket
        elif kind != "trust_status":
            log.debug("not passing a %s frame to replica %s", kind, session.holder)
            return
        self.connection.post(self.subjects.hold(session.holder),
                             messages.hold_message("frame", frame_json.encode(), **header), session.holder)

    def released(self, session: "RemoteSession", slot: "Slot") -> None:
        ticket = slot.ticket
        self._attempts.pop(ticket or "", None)
        if ticket in self._known:
            self._known.discard(ticket)
            self.connection.post(self.subjects.hold(session.holder), messages.hold_message("release", t=ticket),
                                 session.holder)

    def speed(self, session: "RemoteSession", decode_tps: float) -> None:
        self.connection.post(self.subjects.hold(session.holder),
                             messages.hold_message("speed", s=session.id, tps=decode_tps), session.holder)

    def unlinked(self, session: "RemoteSession") -> None:
        self.connection.post(self.subjects.hold(session.holder), messages.hold_message("unlink", s=session.id),
                             session.holder)

    def _looks_full(self, session: "RemoteSession") -> None:
        """Until the holder's next announcement says otherwise, no slot of it looks free here (+1: the
        refused slot is still counted and its release, right after, takes one off)."""
        slots.mirror(session, max(session.active, session.max_concurrency) + 1)

    # the holder's answers

    async def on_back(self, opened: Opened, msg: Any) -> None:
        pending = self._attempts.get(self.subjects.ticket_of(msg.subject))
        if pending is None:
            return  # the attempt is over: late frames are ignored, as on a socket
        holder = pending.session.holder  # type: ignore[attr-defined]  # placed on a RemoteSession
        if opened.sender != holder:
            refuse("impersonation", "request %s: replica %s spoke for its holder %s", pending.request_id,
                   opened.sender, holder)
            return
        try:
            self._feed(pending, messages.json_object(opened.body))
        except Exception:  # noqa: BLE001 - a malformed message fails its attempt, never the subscription
            log.exception("request %s: bad message from the holding replica", pending.request_id)
            pending.on_provider_gone()

    def _feed(self, pending: "PendingRequest", back: dict[str, Any]) -> None:
        session: RemoteSession = pending.session  # type: ignore[assignment]
        kind = back["k"]
        if kind == "chunk":
            if not pending.on_chunk(Envelope.model_validate(back["e"])):
                session_lifecycle.distrust(session, "a response chunk failed decryption")
        elif kind == "complete":
            self._owner_at_completion(session, back.get("account_id"))
            if not pending.on_complete(Usage.model_validate(back["usage"])):
                session_lifecycle.distrust(session, "it reported impossible token usage")
        elif kind == "error":
            pending.on_error(int(back["status"]), str(back["message"]), back.get("param"), back.get("code"))
        elif kind == "busy":
            self._looks_full(session)
            pending.on_provider_gone()
        else:
            self.on_session_gone(session.id)  # fails every attempt on it, this one included
            pending.on_provider_gone()

    def _owner_at_completion(self, session: "RemoteSession", account_id: str | None) -> None:
        """Settlement reads the owner from the serving session: the holder's, read as it completed.
        A session only ever loses its owner (an unlink), so an owner is only ever taken away here."""
        if account_id is None and session.account_id is not None:
            if self.registry.get(session.id) is session:
                self.registry.disown(session)
            else:
                session.account_id = None
                session.machine_id = None
