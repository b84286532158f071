"""The holding side of remote dispatch: requests other replicas place on this replica's sessions.

A claim (``claim.<this>``, request/reply) takes a real slot with ``Slots.claim`` on the real session,
under the ticket the admitting replica chose. A sealed request (``hold.<this>``) is written to the
node's WebSocket as a local one is, and a ``Forwarder`` is the inbox the session delivers to for it:
the session hands it the node's frames as it would a local attempt, and it sends them on to
``back.<admitter>.<ticket>`` untouched (sealed chunks, usage with the session's owner now, error,
disconnection), the frames that reach it in one loop turn in one message (as few as ``max_payload``
allows). The slot is released when the node ends the request (complete, error, gone), when
the admitter releases it (after a cancel, a lost race, a request that never dispatched, a claim it
gave up waiting for), when the admitter goes silent, or when a claim was never used. A release that
comes before its claim (the two travel on different subjects) is remembered, and the claim refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Opened, refuse
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fleet.enrollment import load_ca
from darkbloom.coordinator.fleet.session import UNTRUSTED, ProviderSession
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.services import Services
from darkbloom.wire import json_codec
from darkbloom.wire.protocol import (MAX_REQUEST_FRAME_BYTES, Cancel, Envelope, FrameError, InferenceRequest,
                                     Usage, dump, parse_coordinator_frame)

log = logging.getLogger("darkbloom.fabric")
REAP_EVERY = 1.0
MAX_BUFFERED = 4 * MAX_REQUEST_FRAME_BYTES  # unfinished split frames per sending replica
MAX_DECODE_TPS = 1e6
MAX_RELEASED = 10_000  # releases remembered for claims not come yet (one per claim an admitter gave up on)


@dataclass(eq=False)
class Hosted:
    """A slot on one of this replica's sessions, claimed for an attempt another replica admitted."""

    ticket: str
    admitter: str
    slot: Slot
    claimed_at: float = field(default_factory=time.monotonic)
    forwarder: "Forwarder | None" = None  # once its request was written to the node

    @property
    def session(self) -> ProviderSession:
        return self.slot.session


class Forwarder:
    """A real session's inbox for a remote attempt: the node's frames go back as they came."""

    def __init__(self, holder: "Holder", hosted: Hosted, request_id: str) -> None:
        self.holder = holder
        self.hosted = hosted
        self.request_id = request_id
        self.finished = False
        self.cancelled = False  # the node was told to stop (once is enough)
        self.subject = holder.subjects.back(hosted.admitter, hosted.ticket)
        self._pending: list[bytes] = []  # items of this loop turn, not sent yet
        self._send_soon = False

    def on_chunk(self, envelope: Envelope) -> bool:
        if not self.finished:
            self._pending.append(messages.back_chunk(envelope))
            if not self._send_soon:
                self._send_soon = True
                asyncio.get_running_loop().call_soon(self._send)
        return True  # only the admitting replica can open it; it reports a chunk that does not

    def _send(self) -> None:
        """What came this loop turn, in as few messages as fit (an item too big alone is refused, and
        counted, by the connection)."""
        self._send_soon = False
        pending, self._pending = self._pending, []
        connection = self.holder.connection
        for group in messages.packed(pending, connection.room - 2):  # (-2: the brackets of the array)
            connection.post(self.subject, messages.back_batch(group), self.hosted.admitter)

    def on_complete(self, usage: Usage) -> bool:
        self._end(messages.back_complete(usage, self.hosted.session.account_id))
        return True  # the admitting replica checks the usage against the request's bounds

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        self._end(messages.back_error(status, message, param, code))

    def on_provider_gone(self) -> None:
        self._end(messages.back_gone())

    def unread(self) -> int:
        return 0  # nothing waits here: every chunk is posted as it arrives

    def _end(self, last: bytes) -> None:
        if not self.finished:
            self.finished = True
            self._pending.append(last)  # with the chunks of this turn, in order
            self._send()
            self.holder.end(self.hosted)


class Holder:
    def __init__(self, services: Services, connection: Connection, subjects: Subjects) -> None:
        self.services = services
        self.connection = connection
        self.subjects = subjects
        self.hosted: dict[str, Hosted] = {}
        self.released: dict[tuple[str, str], float] = {}  # (admitter, ticket) released before it was claimed → when
        self.split_frames = messages.SplitFrames(MAX_BUFFERED)
        self._to_reap = asyncio.Event()  # set when a claim or a split frame is kept: the reaper wakes

    # claims

    async def on_claim(self, opened: Opened, msg: Any) -> None:
        try:
            ask = json_codec.loads(opened.body)
            session_id, ticket, claimant = str(ask["session"]), str(ask["ticket"]), ask["from"]
        except (ValueError, KeyError, TypeError):
            refuse("malformed", "a malformed claim from %s", opened.sender)
            return
        if claimant != opened.sender:
            refuse("impersonation", "replica %s claimed for replica %s", opened.sender, claimant)
            return
        ok, why = self._claim(session_id, ticket, claimant)
        self.connection.reply(msg, messages.claim_reply(ok, why), claimant)

    def _claim(self, session_id: str, ticket: str, admitter: str) -> tuple[bool, str]:
        if (admitter, ticket) in self.released:
            return False, "busy"  # its admitter gave up on it before it came
        hosted = self.hosted.get(ticket)
        if hosted is not None:
            return (True, "") if hosted.admitter == admitter and hosted.session.id == session_id else (False, "busy")
        session = self.services.registry.held(session_id)
        if session is None or not session.online:
            return False, "gone"
        if session.untrusted_reason is not None or session.draining or not session.has_free_slot:
            return False, "busy"
        self.hosted[ticket] = Hosted(ticket, admitter, self.services.registry.slots.claim(session))
        self._to_reap.set()
        return True, ""

    def _released_early(self, admitter: str, ticket: str) -> None:
        """A release of a claim not taken (yet, or any more): its claim, should it come, is refused."""
        self.released.pop((admitter, ticket), None)  # (oldest first)
        self.released[(admitter, ticket)] = time.monotonic()
        if len(self.released) > MAX_RELEASED:
            del self.released[next(iter(self.released))]
        self._to_reap.set()

    def end(self, hosted: Hosted) -> None:
        """The attempt is over here: the slot back (which wakes this replica's queues), the entry gone."""
        if self.hosted.get(hosted.ticket) is hosted:
            del self.hosted[hosted.ticket]
        forwarder = hosted.forwarder
        if forwarder is not None:
            forwarder.finished = True
            hosted.session.close_inbox(forwarder.request_id, forwarder)
        hosted.slot.release()

    def _cancel(self, hosted: Hosted) -> None:
        forwarder = hosted.forwarder
        if forwarder is not None and not forwarder.finished and not forwarder.cancelled:
            hosted.session.send(dump(Cancel(request_id=forwarder.request_id)))
        self.end(hosted)

    # messages to the holder

    async def on_hold(self, opened: Opened, msg: Any) -> None:
        try:
            header, payload = messages.read_hold(opened.body)
            self._handle(opened.sender, header, payload)
        except Exception:  # noqa: BLE001 - one bad message never stops the subscription
            log.exception("bad message from %s on %s", opened.sender, msg.subject)

    def _handle(self, sender: str, header: dict[str, Any], payload: bytes) -> None:
        kind = header["k"]
        if kind == "request":
            if header.get("f") != sender:
                refuse("impersonation", "replica %s sent a request for replica %s", sender, header.get("f"))
                return
            frame = self.split_frames.add(sender, header, payload)
            if frame is None and len(self.split_frames):
                self._to_reap.set()
            if frame is not None:
                self._request(header, frame)
        elif kind == "release":
            ticket = header.get("t")
            hosted = self._hosted_for(sender, ticket)
            if hosted is not None:
                self._cancel(hosted)  # over for the admitter: the node stops too, if it has not
            elif isinstance(ticket, str) and ticket not in self.hosted:
                self._released_early(sender, ticket)
        elif kind == "frame":
            self._frame(sender, header, payload)
        elif kind == "speed":
            session = self._local(header["s"])
            tps = float(header["tps"])
            if session is not None and 0.0 <= tps <= MAX_DECODE_TPS:
                session.report_speed(tps)
        elif kind == "unlink":
            session = self._local(header["s"])
            if session is not None:
                session.retire()

    def _hosted_for(self, sender: str, ticket: Any) -> Hosted | None:
        """The claim ``ticket`` names, when ``sender`` made it (a replica speaks for its own requests only)."""
        hosted = self.hosted.get(ticket) if isinstance(ticket, str) else None
        if hosted is not None and hosted.admitter != sender:
            refuse("impersonation", "replica %s spoke for a request of replica %s", sender, hosted.admitter)
            return None
        return hosted

    def _request(self, header: dict[str, Any], data: bytes) -> None:
        """Write an ``inference_request`` for a request not already on the session to the node; nothing
        else ever reaches a node from another replica (what it writes is the frame as parsed here)."""
        ticket, admitter, request_id = str(header["t"]), header["f"], header["r"]
        back = self.subjects.back(admitter, ticket)
        try:
            frame = parse_coordinator_frame(data)
        except FrameError:
            frame = None
        if not isinstance(frame, InferenceRequest) or frame.request_id != request_id:
            refuse("not_a_request", "replica %s sent a request message that is not an inference_request for %s",
                    admitter, request_id)
            return
        session = self._local(header["s"])
        if session is not None and (request_id in session.inboxes or len(data) > session.registration.max_request_frame_bytes):
            refuse("not_a_request", "replica %s sent request %s, already on %s or too big for it", admitter,
                    request_id, session.id)
            self.connection.post(back, messages.back_batch([messages.back_gone("busy")]), admitter)
            return
        ok, why = self._claim(header["s"], ticket, admitter)
        if not ok:
            self.connection.post(back, messages.back_batch([messages.back_gone(why)]), admitter)
            return
        hosted = self.hosted[ticket]
        session = hosted.session
        if not session.online or session.link.closing or hosted.forwarder is not None:
            self.connection.post(back, messages.back_batch([messages.back_gone()]), admitter)
            self.end(hosted)
            return
        hosted.forwarder = Forwarder(self, hosted, request_id)
        session.open_inbox(request_id, hosted.forwarder)
        session.send(dump(frame))

    def _frame(self, sender: str, header: dict[str, Any], data: bytes) -> None:
        frame = parse_coordinator_frame(data)
        kind = frame.type
        if kind == "cancel":
            hosted = self._hosted_for(sender, header.get("t"))
            forwarder = hosted.forwarder if hosted is not None else None
            if hosted is not None and forwarder is not None and not forwarder.finished and not forwarder.cancelled:
                forwarder.cancelled = True
                # the node reports its partial usage, forwarded as usual
                hosted.session.send(dump(Cancel(request_id=forwarder.request_id)))
            return
        session = self._local(header["s"])
        if session is None or kind != "trust_status":
            return
        if frame.trust_level == UNTRUSTED:
            session.distrust(frame.reason or "another replica found it untrustworthy")
        elif frame.certificate:
            self.services.spawn(self._enrolled(session, frame.certificate))

    async def _enrolled(self, session: ProviderSession, certificate: str) -> None:
        """An admin enrolled the machine through another replica: the same as through this one."""
        ca = await load_ca(self.services.engine)
        if ca is not None:
            session.enrolled(certificate, ca)

    def _local(self, session_id: str) -> ProviderSession | None:
        return self.services.registry.held(session_id)

    # the admitting replica went away, and claims nobody used

    def admitter_gone(self, replica: str) -> None:
        self.split_frames.forget(replica)  # the rest of its frames will never come
        for hosted in [h for h in self.hosted.values() if h.admitter == replica]:
            log.info("replica %s is gone: cancelling its request on %s", replica, hosted.session.id)
            self._cancel(hosted)

    async def reap_forever(self) -> None:
        settings = self.services.settings
        unused_after = settings.first_content_timeout + 5
        longest = settings.request_timeout + settings.cancel_grace + 5
        while True:
            if not self.hosted and not self.released and not len(self.split_frames):
                self._to_reap.clear()
                await self._to_reap.wait()  # an idle replica does not wake for nothing
            await asyncio.sleep(REAP_EVERY)
            now = time.monotonic()
            self.split_frames.reap(now - unused_after)  # split frames whose last parts never came
            while self.released and next(iter(self.released.values())) < now - unused_after:
                del self.released[next(iter(self.released))]  # as late a claim would have been reaped
            for hosted in list(self.hosted.values()):
                if hosted.session.link.closing and hosted.forwarder is None:
                    self.end(hosted)  # claimed, never used, and its session is closing
                    continue
                age = now - hosted.claimed_at
                if age > (longest if hosted.forwarder is not None else unused_after):
                    log.warning("claim %s on %s outlived any request: released", hosted.ticket, hosted.session.id)
                    self._cancel(hosted)
