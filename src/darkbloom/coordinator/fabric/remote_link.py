"""The admitting side of remote dispatch: the link of a stand-in, a session another replica holds.

What this replica asks of such a session goes to its holder. A slot claimed on it gets a ticket;
``confirm`` claims it on the holder (request/reply on ``claim.<holder>``); the sealed request goes
(in parts when it is bigger than the server's ``max_payload``) on ``hold.<holder>``, which also
claims an unconfirmed ticket (a retry or a backup, placed without waiting); a cancel or a trust
status passes as a frame; a release, a measured speed and an unlink are reported. The holder's
answers arrive on ``back.<this>.<ticket>`` and the stand-in delivers them to the attempt's inbox
exactly as a local session delivers its socket's frames, including the checks that make a provider
untrusted (the chunks open only here). The holder sends the frames of one attempt that reach it in
one loop turn as one message (a JSON array of them).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Callable

from prometheus_client import Counter

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Opened, refuse
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fleet import slots
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire import json_codec
from darkbloom.wire.protocol import Cancel, Envelope, Usage, dump

log = logging.getLogger("darkbloom.fabric")
CLAIM_TIMEOUT = 2.0  # seconds for the holder to answer a claim; after it, the slot counts as busy
LOOKS_FULL_FOR = 1.0  # seconds a refused stand-in looks full, unless its holder announces it sooner
ENDED_THERE = frozenset({"complete", "error", "gone"})  # what the holder sends as it releases the claim
REMOTE_REQUESTS = Counter("darkbloom_fabric_remote_requests",
                          "Attempts this replica admitted and sent to a session another replica holds")


class RemoteLink:
    """A stand-in's link to ``holder``, the replica (instance id) holding the real session."""

    only_proven_chunks = True  # a replica announces only sessions whose chunks prove their node
    closing = False            # not this replica's socket: the holder closes it
    session: ProviderSession   # the stand-in, bound as it is made (``fabric.view``)
    announced_active = 0       # the holder's count of the session's active requests, as last announced

    def __init__(self, holder: str, outbound: "Outbound") -> None:
        self.holder = holder
        self.outbound = outbound

    def send(self, frame_json: str) -> None:
        self.outbound.send_frame(self, frame_json)

    def send_request(self, request_id: str, ticket: str | None, frame_json: str) -> None:
        assert ticket is not None
        self.outbound.send_request(self, request_id, ticket, frame_json)

    def cancel(self, request_id: str, ticket: str | None) -> None:
        if ticket is not None:
            self.outbound.cancel(self, request_id, ticket)

    def claimed(self) -> str:
        return secrets.token_hex(8)

    async def confirm(self, ticket: str | None) -> bool:
        assert ticket is not None
        return await self.outbound.confirm(self, ticket)

    def released(self, ticket: str | None) -> None:
        self.outbound.released(self, ticket)

    def report_speed(self, decode_tps: float) -> None:
        self.outbound.speed(self, decode_tps)  # measured here, at settlement: the holder keeps it for everyone

    def retire(self) -> None:
        self.outbound.unlinked(self)

    def close(self, code: int = 1000) -> None:
        """Not this replica's socket: the holder closes it."""


class Outbound:
    """The one admitting side of this replica, which every stand-in's link speaks through."""

    def __init__(self, connection: Connection, subjects: Subjects, registry: Registry) -> None:
        self.connection = connection
        self.subjects = subjects
        self.registry = registry
        self._placed: dict[str, tuple[RemoteLink, str]] = {}  # ticket → the link and request its frames are for
        self._known: set[str] = set()                         # tickets the holder may have claimed
        # the holder says the session is gone: drop its stand-in now (set by the Fabric to the view's
        # drop), so a retry or the Self-Route pre-flight sees at once what a local disconnect shows
        self.on_session_gone: Callable[[str], None] = lambda _session_id: None

    async def confirm(self, link: RemoteLink, ticket: str) -> bool:
        session = link.session
        self._known.add(ticket)
        reply = await self.connection.request(self.subjects.claim(link.holder),
                                              messages.claim_request(session.id, ticket, self.subjects.replica),
                                              link.holder, CLAIM_TIMEOUT)
        try:
            answer = messages.json_object(reply.body) if reply is not None else {"ok": False, "why": "no answer"}
        except ValueError:
            answer = {"ok": False, "why": "a malformed answer"}
        if answer.get("ok"):
            return True
        log.info("replica %s refused a slot on %s: %s", link.holder, session.id, answer.get("why"))
        self._looks_full(session)
        return False

    def send_request(self, link: RemoteLink, request_id: str, ticket: str, frame_json: str) -> None:
        self._placed[ticket] = (link, request_id)
        self._known.add(ticket)
        REMOTE_REQUESTS.inc()
        for part in messages.hold_parts("request", frame_json.encode(), self.connection.max_payload, t=ticket,
                                        s=link.session.id, r=request_id, f=self.subjects.replica):
            self.connection.post(self.subjects.hold(link.holder), part, link.holder)

    def cancel(self, link: RemoteLink, request_id: str, ticket: str) -> None:
        """For the holder to pass to the node, for the attempt of that ticket only."""
        self._post_frame(link, dump(Cancel(request_id=request_id)), t=ticket)

    def send_frame(self, link: RemoteLink, frame_json: str) -> None:
        """A trust status, for the holder to apply; no other frame is passed."""
        kind = json_codec.loads(frame_json).get("type")
        if kind != "trust_status":
            log.debug("not passing a %s frame to replica %s", kind, link.holder)
            return
        self._post_frame(link, frame_json)

    def _post_frame(self, link: RemoteLink, frame_json: str, **header: Any) -> None:
        self.connection.post(self.subjects.hold(link.holder),
                             messages.hold_message("frame", frame_json.encode(), s=link.session.id,
                                                   f=self.subjects.replica, **header), link.holder)

    def released(self, link: RemoteLink, ticket: str | None) -> None:
        self._placed.pop(ticket or "", None)
        if ticket in self._known:
            self._known.discard(ticket)
            self.connection.post(self.subjects.hold(link.holder), messages.hold_message("release", t=ticket),
                                 link.holder)

    def speed(self, link: RemoteLink, decode_tps: float) -> None:
        self.connection.post(self.subjects.hold(link.holder),
                             messages.hold_message("speed", s=link.session.id, tps=decode_tps), link.holder)

    def unlinked(self, link: RemoteLink) -> None:
        self.connection.post(self.subjects.hold(link.holder), messages.hold_message("unlink", s=link.session.id),
                             link.holder)

    def _looks_full(self, session: ProviderSession) -> None:
        """For ``LOOKS_FULL_FOR`` (or until the holder announces it), no slot of it looks free here
        (+1: the refused slot is still counted and its release, right after, takes one off); then it
        has the count its holder last announced (the holder announces a session when it changes, so
        a refusal that was no answer at all must not leave it full for good)."""
        slots.mirror(session, max(session.active, session.max_concurrency) + 1)
        asyncio.get_running_loop().call_later(LOOKS_FULL_FOR, self._as_announced, session)

    def _as_announced(self, session: ProviderSession) -> None:
        link = session.link
        if self.registry.get(session.id) is session and isinstance(link, RemoteLink):
            slots.mirror(session, link.announced_active)

    # the holder's answers

    async def on_back(self, opened: Opened, msg: Any) -> None:
        ticket = self.subjects.ticket_of(msg.subject)
        placed = self._placed.get(ticket)
        if placed is None:
            return  # the attempt is over: late frames are ignored, as on a socket
        link, request_id = placed
        if opened.sender != link.holder:
            refuse("impersonation", "request %s: replica %s spoke for its holder %s", request_id,
                   opened.sender, link.holder)
            return
        try:
            for item in messages.back_items(opened.body):
                if item["k"] in ENDED_THERE:
                    self._known.discard(ticket)  # the holder has released it: nothing to tell it
                self._deliver(link.session, request_id, item)
        except Exception:  # noqa: BLE001 - a malformed message fails its attempt, never the subscription
            log.exception("request %s: bad message from the holding replica", request_id)
            link.session.deliver_gone(request_id)

    def _deliver(self, session: ProviderSession, request_id: str, back: dict[str, Any]) -> None:
        kind = back["k"]
        if kind == "chunk":
            session.deliver_chunk(request_id, Envelope.model_validate(back["e"]))
        elif kind == "complete":
            self._owner_at_completion(session, back.get("account_id"))
            session.deliver_complete(request_id, Usage.model_validate(back["usage"]))
        elif kind == "error":
            session.deliver_error(request_id, int(back["status"]), str(back["message"]), back.get("param"),
                                  back.get("code"))
        elif kind == "busy":
            self._looks_full(session)
            session.deliver_gone(request_id)
        else:
            self.on_session_gone(session.id)  # fails every attempt on it, this one included
            session.deliver_gone(request_id)

    def _owner_at_completion(self, session: ProviderSession, account_id: str | None) -> None:
        """Settlement reads the owner from the serving session: the holder's, read as it completed.
        A session only ever loses its owner (an unlink), so an owner is only ever taken away here."""
        if account_id is None and session.account_id is not None:
            session.disown()
