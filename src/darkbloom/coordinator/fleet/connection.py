"""ProviderConnection: a provider node's WebSocket on this replica, from its ``register`` frame to its
close, and the link of the session it registered (``fleet/link.py``).

- **Registration**: the first frame must be ``register`` (within ``REGISTER_TIMEOUT``); its session's
  owner comes from the device token only, its trust from the attestation and certificate. A task beside
  the reader (challenges never block reading) sends the first attestation challenge; once it is
  answered or failed the session is listed, told ``registered`` and marked online; then it is
  challenged every ``challenge_interval`` while trusted. The outstanding challenge is the connection's.
- **Reading**: a bad frame is answered with an ``error`` frame, the third closes the socket (1008); a
  frame refused as too large fails the request it names; reading pauses while a request has more than
  ``MAX_UNREAD_CHUNKS`` chunks unrelayed. A request's frames go to the session (``deliver_*``), which
  hands them to the request's inbox; heartbeats go to the session too.
- **Writing and closing**: frames wait in ``outbox`` for the socket's single writer. ``close`` takes the
  session out of routing, fails what it served, marks its machine, then closes the socket after what
  was queued — at the end of reading, on eviction for silence (``Registry.evict_silent``), once an
  unlinked machine is idle, at shutdown.

``online`` means "connected and registered"; ``untrusted_reason`` means "failed a check, never routable
again": an untrusted session stays online (docs/protocol.md "Registration and trust").
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import NoReturn

from fastapi import WebSocket, WebSocketDisconnect
from prometheus_client import Histogram

from darkbloom.coordinator.fleet.enrollment import EnrollmentCA, load_ca
from darkbloom.coordinator.fleet.registration_gate import Registering
from darkbloom.coordinator.fleet.session import FRAME_TOO_LARGE, UNTRUSTED, ProviderSession
from darkbloom.coordinator.fleet.trust import (certificate_problem, challenge_failure, new_challenge,
                                              registration_trust, runtime_allowed)
from darkbloom.coordinator.services import Services
from darkbloom.coordinator.websocket_protocol import mute_repeats
from darkbloom.wire.chunk_arrays import MAX_CHUNKS_PER_FRAME
from darkbloom.wire.crypto import DecryptionError, new_id, public_key_from_b64, token_hash
from darkbloom.wire.protocol import (AttestationChallenge, AttestationResponse, Cancel, ErrorFrame, FrameError,
                                     Heartbeat, InferenceComplete, InferenceError, InferenceResponseChunk,
                                     Register, Registered, TrustStatus, dump, parse_provider_frame)

log = logging.getLogger("darkbloom.sessions")

REGISTER_TIMEOUT = 30.0
MAX_BAD_FRAMES = 3
MAX_UNREAD_CHUNKS = 2 * MAX_CHUNKS_PER_FRAME
CLOSE_DRAIN_SECONDS = 2.0  # after the reader ends, for the frames queued before the close to leave
UNLINK_DRAIN_LIMIT = 600.0  # an unlinked machine's session closes once idle, or after this many seconds
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009  # the socket's own limit (SOCKET_MESSAGE_LIMIT) closed it
SERVICE_RESTART = 1012  # tells a node this process is stopping (docs/protocol.md "Reconnecting")
_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"([^"\\]{1,256})"')
REGISTRATION_SECONDS = Histogram(
    "darkbloom_registration_seconds",
    "From a provider socket's accept to its registered frame (the first challenge included), by the trust "
    "it registered with: none, self_signed, hardware, untrusted",
    ["trust"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


class _TooManyBadFrames(Exception):
    pass


@dataclass(eq=False)
class _Outstanding:
    challenge: AttestationChallenge
    answered: asyncio.Future[str | None]  # the failure, or None when the answer passed


class OutboxLink:
    """The link of a session on this replica: every frame for the node waits in ``outbox`` for the
    socket's single writer (``ProviderConnection``, which builds on it; or a test playing the
    node), and a close puts ``None`` there after them."""

    only_proven_chunks = False  # the registration says whether its chunks are sealed with its key

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.close_code: int | None = None

    @property
    def closing(self) -> bool:
        return self.close_code is not None

    def send(self, frame_json: str) -> None:
        self.outbox.put_nowait(frame_json)

    def send_request(self, request_id: str, ticket: str | None, frame_json: str) -> None:
        self.outbox.put_nowait(frame_json)

    def cancel(self, request_id: str, ticket: str | None) -> None:
        self.outbox.put_nowait(dump(Cancel(request_id=request_id)))

    def claimed(self) -> None:
        return None

    async def confirm(self, ticket: str | None) -> bool:
        return True  # a slot of a session of this process is always its own

    def released(self, ticket: str | None) -> None:
        pass

    def report_speed(self, decode_tps: float) -> None:
        pass  # the session object is the one everybody on this replica reads

    def retire(self) -> None:
        self.close()

    def close(self, code: int = 1000) -> None:
        if self.close_code is None:
            self.close_code = code
            self.outbox.put_nowait(None)


class ProviderConnection(OutboxLink):
    def __init__(self, services: Services, websocket: WebSocket) -> None:
        super().__init__()
        self.services = services
        self.websocket = websocket
        self.session: ProviderSession | None = None  # opened by the register frame
        self.bad_frames = 0
        self._outstanding: _Outstanding | None = None  # the challenge not answered yet (at most one)

    async def serve(self, registering: Registering) -> None:
        """The socket from its accept to its close; ``registering`` is given back once it is registered."""
        accepted_at = time.monotonic()
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT):
                registration = await self._first_register()
        except (TimeoutError, WebSocketDisconnect, _TooManyBadFrames):
            await close_quietly(self.websocket, POLICY_VIOLATION)
            return
        session = await self.open(registration, accepted_at)
        writer = asyncio.create_task(self._write())
        trust = asyncio.create_task(self.keep_trust(registering))
        socket_closed = False
        try:
            await self._read(session)
        except WebSocketDisconnect as gone:
            socket_closed = True
            if gone.code == MESSAGE_TOO_BIG:
                for request_id in list(session.inboxes):
                    session.deliver_error(request_id, 502, "", code=FRAME_TOO_LARGE)
        except _TooManyBadFrames:
            pass
        finally:
            trust.cancel()
            self.close(POLICY_VIOLATION if self.bad_frames >= MAX_BAD_FRAMES else 1000)
            if socket_closed:  # by the node, or by the server's shutdown (1012 to every socket): nothing left to send
                writer.cancel()
            elif not (await asyncio.wait({writer}, timeout=CLOSE_DRAIN_SECONDS))[0]:
                writer.cancel()

    # registration and trust

    async def open(self, registration: Register, accepted_at: float) -> ProviderSession:
        """The session of the ``register`` frame, whose socket was accepted at ``accepted_at`` (monotonic)."""
        token, owner = registration.auth_token, None
        if token and token.startswith("dkp-"):  # the owner comes only from the device token, never from the frame
            owner = await self.services.device_owners.owner(token_hash(token))
        try:
            public_key = public_key_from_b64(registration.public_key)
        except DecryptionError:
            public_key = None
        runtime_verified = runtime_allowed(self.services.settings, registration.runtime_hash)
        self.session = session = ProviderSession(
            id=new_id("prov_"), account_id=owner[0] if owner else None, machine_id=owner[1] if owner else None,
            registration=registration, public_key=public_key, link=self, connected_at=accepted_at,
            trust_level=await self._registration_trust(registration) if public_key is not None else "none",
            runtime_verified=runtime_verified, book=self.services.machine_book,
            untrusted_reason=None if public_key is not None else "no valid X25519 public key")
        if not runtime_verified:
            log.warning("provider %s: runtime hash %s is not in the allow-list (runtime not verified)",
                        session.id, registration.runtime_hash or "(none)")
        return session

    async def _registration_trust(self, registration: Register) -> str:
        """``self_signed`` from the attestation blob; ``hardware`` when it also presents a certificate
        from this coordinator's enrollment CA for its identity key."""
        ca: EnrollmentCA | None = None
        if registration.certificate:
            try:
                ca = await load_ca(self.services.engine)
            except Exception:  # noqa: BLE001 - an unreadable CA means no hardware trust, not a dead socket
                log.exception("cannot load the enrollment CA")
        level = registration_trust(registration, ca)
        if registration.certificate and level == "self_signed":
            log.warning("a provider presented a certificate that does not prove hardware trust: %s",
                        certificate_problem(registration, ca))
        return level

    async def keep_trust(self, registering: Registering) -> None:
        """The session's trust work, for as long as the socket is open: the first challenge (part of
        registration), then ``complete_registration`` (``registering`` ends there), then a challenge
        every ``challenge_interval`` while the session is trusted."""
        session = self.session
        assert session is not None, "no session before its register frame"
        try:
            if session.untrusted_reason is None:
                await self._challenge(session)
            self.complete_registration()
            registering.done()
            while session.untrusted_reason is None:
                await asyncio.sleep(self.services.settings.challenge_interval)
                await self._challenge(session)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - without its trust checks a session must not stay connected
            log.exception("provider %s: trust checks failed; closing the session", session.id)
            self.close(1011)

    async def _challenge(self, session: ProviderSession) -> None:
        """One challenge, judged by ``answer``; no answer within ``challenge_deadline`` distrusts."""
        deadline = self.services.settings.challenge_deadline
        outstanding = self._outstanding = _Outstanding(new_challenge(), asyncio.get_running_loop().create_future())
        try:
            self.send(dump(outstanding.challenge))
            async with asyncio.timeout(deadline):
                await outstanding.answered
        except TimeoutError:
            session.distrust(f"no answer to the attestation challenge within {deadline:g} s")
        finally:
            if self._outstanding is outstanding:
                self._outstanding = None

    def answer(self, frame: AttestationResponse) -> None:
        """Judge an answer at once: a pass is recorded; a bad signature or a changed runtime hash
        distrusts the session. An answer to no outstanding challenge (unsolicited, or after its
        deadline) is ignored."""
        session, outstanding = self.session, self._outstanding
        if session is None or outstanding is None or outstanding.answered.done() \
                or frame.nonce != outstanding.challenge.nonce:
            log.info("provider %s: ignoring an attestation response to no outstanding challenge",
                     session.id if session else "(unregistered)")
            return
        failure = challenge_failure(outstanding.challenge, frame, session.registration)
        if failure is None:
            session.record_challenge_pass(time.monotonic())
            log.debug("provider %s passed an attestation challenge", session.id)
        else:
            session.distrust(failure)
        outstanding.answered.set_result(failure)

    def complete_registration(self) -> None:
        """After the first challenge: list the session (online, routable if trusted) and tell the node."""
        session = self.session
        if session is None or self.closing:
            return  # the socket is closing; never list it
        self.services.registry.add(session)
        self.send(dump(Registered(provider_id=session.id, account_id=session.account_id,
                                  machine_id=session.machine_id, trust_level=session.effective_trust,
                                  chunk_arrays=True)))
        if session.untrusted_reason is not None:
            self.send(dump(TrustStatus(trust_level=UNTRUSTED, reason=session.untrusted_reason)))
        session.mark_online()
        REGISTRATION_SECONDS.labels(session.effective_trust).observe(time.monotonic() - session.connected_at)
        session.mark_machine()
        log.info("provider %s registered: account=%s machine=%s models=%s trust=%s runtime_verified=%s "
                 "private_only=%s", session.id, session.account_id, session.machine_id,
                 sorted(session.advertised_models), session.effective_trust, session.runtime_verified,
                 session.private_only)

    # reading

    async def _first_register(self) -> Register:
        while True:
            frame = await self._receive()
            if isinstance(frame, Register):
                return frame
            await self._strike("not_registered", "the first frame must be 'register'")

    async def _read(self, session: ProviderSession) -> None:
        while True:
            frame = await self._receive()
            session.last_frame_at = time.monotonic()
            if isinstance(frame, InferenceResponseChunk):
                session.deliver_chunk(frame.request_id, frame.encrypted_data)
                await self._relayed(session, frame.request_id)
            elif isinstance(frame, InferenceComplete):
                session.deliver_complete(frame.request_id, frame.usage)
            elif isinstance(frame, InferenceError):
                session.deliver_error(frame.request_id, frame.status_code, frame.message, frame.param, frame.code)
            elif isinstance(frame, Heartbeat):
                session.heartbeat(frame)
            elif isinstance(frame, AttestationResponse):
                self.answer(frame)
            elif isinstance(frame, Register):
                await self._strike("already_registered", "this session is already registered")
            # inference_accepted needs no action: the request is already counted on the session

    async def _receive(self) -> object:
        """The next well-formed frame; bad frames get an error frame, the third one closes (1008)."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            try:
                frame = parse_provider_frame(raw)
            except FrameError as exc:
                if exc.code == FRAME_TOO_LARGE and self.session is not None:
                    _fail_refused_request(self.session, raw)
                if exc.frame_type == "register" and self.session is None:
                    await self._refuse(exc.code, f"{exc.message}; registration refused: fix what the node reports "
                                                 "(docs/protocol.md \"Bounds\") and connect again")
                await self._strike(exc.code, exc.message)
            else:
                if isinstance(frame, Heartbeat) and isinstance(raw, str) and self.session is not None:
                    # for a while its repeats only refresh liveness (the socket's protocol holds them back)
                    mute_repeats(self.websocket, raw, self.session.unchanged_heartbeats_idle_for(),
                                 self.session.heard)
                return frame

    async def _relayed(self, session: ProviderSession, request_id: str) -> None:
        """Let the loop run after each chunk frame, and read nothing more from this socket while one
        request has more chunks waiting than MAX_UNREAD_CHUNKS: a provider cannot pile chunks up faster
        than they are relayed (a backlog of millions of objects would stall the loop in garbage collection)."""
        await asyncio.sleep(0)
        while session.unread(request_id) > MAX_UNREAD_CHUNKS:
            session.last_frame_at = time.monotonic()  # it is this side that is not reading
            await asyncio.sleep(0.01)

    async def _strike(self, code: str, message: str) -> None:
        self.bad_frames += 1
        await self._reply(dump(ErrorFrame(code=code, message=message)))
        if self.bad_frames >= MAX_BAD_FRAMES:
            raise _TooManyBadFrames()

    async def _refuse(self, code: str, message: str) -> NoReturn:
        """A frame after which nothing the node sends can help (a ``register`` refused): its error
        frame, then the socket closes (1008) as after the last strike."""
        self.bad_frames = MAX_BAD_FRAMES
        await self._reply(dump(ErrorFrame(code=code, message=message)))
        raise _TooManyBadFrames()

    async def _reply(self, frame_json: str) -> None:
        """Directly before registration; through the single writer after it."""
        if self.session is not None:
            self.send(frame_json)
        else:
            await self.websocket.send_text(frame_json)

    # the link: what differs from OutboxLink's

    def retire(self) -> None:
        self.services.spawn(self._close_when_idle())

    async def _close_when_idle(self) -> None:
        deadline = time.monotonic() + UNLINK_DRAIN_LIMIT
        while self.session is not None and self.session.inboxes and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.close(1000)

    def close(self, code: int = 1000) -> None:
        """Take the session out of routing, fail whatever it was serving and mark its machine (once);
        then close the socket with ``code`` after the frames queued before now."""
        session = self.session
        if session is not None and self.services.registry.remove(session):
            session.disconnected()
            log.info("provider %s disconnected", session.id)
            session.mark_machine()
        super().close(code)

    async def _write(self) -> None:
        """The socket's only writer; a ``None`` in the outbox closes the socket with its code."""
        while True:
            frame = await self.outbox.get()
            if frame is None:
                await close_quietly(self.websocket, self.close_code or 1000)
                return
            try:
                await self.websocket.send_text(frame)
            except Exception:  # noqa: BLE001 - a dead socket ends the writer; the reader cleans up
                return


def _fail_refused_request(session: ProviderSession, raw: str | bytes) -> None:
    """A frame over the limit is refused unread; the request it names fails, rather than completing
    without what the frame carried."""
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    found = _REQUEST_ID.search(text)
    if found is not None:
        session.deliver_error(found.group(1), 502, "", code=FRAME_TOO_LARGE)


async def close_quietly(websocket: WebSocket, code: int) -> None:
    try:
        await websocket.close(code=code)
    except Exception:  # noqa: BLE001 - already closed
        pass

