"""WebSocket endpoint the provider nodes dial into (docs/protocol.md "Frames").

``ProviderSocketFirst`` serves it from the top of the app's middleware stack: a node's socket lives
for hours, none of the HTTP layers (CORS, body limits, exception handlers, routing, dependency
solving) applies to it, and what they keep per connection was a fifth of a connected node's memory
(bench/fleet_scale.py; bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import NoReturn

from fastapi import WebSocket, WebSocketDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from darkbloom.coordinator.fleet import session_lifecycle
from darkbloom.coordinator.fleet.registration_gate import TRY_AGAIN_LATER, Registering
from darkbloom.coordinator.fleet.session import FRAME_TOO_LARGE, ProviderSession
from darkbloom.coordinator.fleet.socket_link import SocketLink
from darkbloom.coordinator.websocket_protocol import mute_repeats
from darkbloom.coordinator.services import Services
from darkbloom.wire.chunk_arrays import MAX_CHUNKS_PER_FRAME
from darkbloom.wire.protocol import (
    AttestationResponse,
    ErrorFrame,
    FrameError,
    Heartbeat,
    InferenceComplete,
    InferenceError,
    InferenceResponseChunk,
    Register,
    dump,
    parse_provider_frame,
)

log = logging.getLogger("darkbloom.provider_ws")
PATH = "/ws/provider"

MAX_BAD_FRAMES = 3
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009  # the socket's own limit (SOCKET_MESSAGE_LIMIT) closed it
REGISTER_TIMEOUT = 30.0
MAX_UNREAD_CHUNKS = 2 * MAX_CHUNKS_PER_FRAME
_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"([^"\\]{1,256})"')


class _Strikes:
    """Counts bad frames and knows how to answer them (directly before registration, through
    the session's single writer after it)."""

    def __init__(self, websocket: WebSocket) -> None:
        self.count = 0
        self.session: ProviderSession | None = None
        self._websocket = websocket

    async def reply(self, frame: str) -> None:
        if self.session is not None:
            self.session.send(frame)
        else:
            await self._websocket.send_text(frame)

    async def strike(self, code: str, message: str) -> None:
        self.count += 1
        await self.reply(dump(ErrorFrame(code=code, message=message)))
        if self.count >= MAX_BAD_FRAMES:
            raise _TooManyBadFrames()

    async def refuse(self, code: str, message: str) -> NoReturn:
        """A frame after which nothing the node sends can help (a ``register`` refused): its error
        frame, then the socket closes (1008) as after the last strike."""
        self.count = MAX_BAD_FRAMES
        await self.reply(dump(ErrorFrame(code=code, message=message)))
        raise _TooManyBadFrames()


class ProviderSocketFirst:
    """ASGI middleware, the app's outermost: ``PATH`` as a WebSocket goes straight to
    ``provider_socket``; everything else to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == PATH:
            await provider_socket(WebSocket(scope, receive, send))
        else:
            await self.app(scope, receive, send)


async def provider_socket(websocket: WebSocket) -> None:
    services: Services = websocket.app.state.services
    await websocket.accept()
    registering = services.registrations.enter()
    if registering is None:
        await _close_quietly(websocket, TRY_AGAIN_LATER)
        return
    try:
        await _serve(websocket, services, registering)
    except asyncio.CancelledError:
        # only the server's shutdown cancels a socket's handler (past its grace): the session was taken
        # down on the way out of _serve and the socket is closed; a traceback per socket would say nothing
        pass
    finally:
        registering.done()


async def _serve(websocket: WebSocket, services: Services, registering: Registering) -> None:
    accepted_at = time.monotonic()
    strikes = _Strikes(websocket)
    try:
        async with asyncio.timeout(REGISTER_TIMEOUT):
            registration = await _first_register(websocket, strikes)
    except (TimeoutError, WebSocketDisconnect, _TooManyBadFrames):
        await _close_quietly(websocket, POLICY_VIOLATION)
        return
    link = SocketLink()
    session = await session_lifecycle.open_session(services, registration, link, accepted_at)
    strikes.session = session
    writer = asyncio.create_task(_write_frames(websocket, link))
    # The first challenge, then `registered`, then periodic challenges: beside the reader, never in its way.
    trust = asyncio.create_task(session_lifecycle.run_trust(services, session, registering))
    socket_closed = False
    try:
        await _read_frames(websocket, services, session, strikes)
    except WebSocketDisconnect as gone:
        socket_closed = True
        if gone.code == MESSAGE_TOO_BIG:
            for request_id in list(session.inboxes):
                session.deliver_error(request_id, 502, "", code=FRAME_TOO_LARGE)
    except _TooManyBadFrames:
        pass
    finally:
        trust.cancel()
        session_lifecycle.close_session(services, session)
        session.close(POLICY_VIOLATION if strikes.count >= MAX_BAD_FRAMES else 1000)
        if socket_closed:  # by the node, or by the server's shutdown (1012 to every socket): nothing left to send
            writer.cancel()
        elif not (await asyncio.wait({writer}, timeout=2))[0]:  # the close frame, after what was queued
            writer.cancel()


class _TooManyBadFrames(Exception):
    pass


async def _receive(websocket: WebSocket, strikes: _Strikes) -> object:
    """The next well-formed frame; bad frames get an error frame, the third one closes (1008)."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        try:
            frame = parse_provider_frame(raw)
        except FrameError as exc:
            if exc.code == "frame_too_large" and strikes.session is not None:
                _fail_refused_request(strikes.session, raw)
            if exc.frame_type == "register" and strikes.session is None:
                await strikes.refuse(exc.code, f"{exc.message}; registration refused: fix what the node reports "
                                               "(docs/protocol.md \"Bounds\") and connect again")
            await strikes.strike(exc.code, exc.message)
        else:
            if isinstance(frame, Heartbeat) and isinstance(raw, str) and strikes.session is not None:
                # for a while its repeats only refresh liveness (the socket's protocol holds them back)
                mute_repeats(websocket, raw, session_lifecycle.unchanged_heartbeats_idle_for(strikes.session),
                             strikes.session.heard)
            return frame


def _fail_refused_request(session: ProviderSession, raw: str | bytes) -> None:
    """A frame over the limit is refused unread; the request it names fails, rather than completing
    without what the frame carried."""
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    found = _REQUEST_ID.search(text)
    if found is not None:
        session.deliver_error(found.group(1), 502, "", code=FRAME_TOO_LARGE)


async def _first_register(websocket: WebSocket, strikes: _Strikes) -> Register:
    while True:
        frame = await _receive(websocket, strikes)
        if isinstance(frame, Register):
            return frame
        await strikes.strike("not_registered", "the first frame must be 'register'")


async def _read_frames(websocket: WebSocket, services: Services, session: ProviderSession,
                       strikes: _Strikes) -> None:
    while True:
        frame = await _receive(websocket, strikes)
        session.last_frame_at = time.monotonic()
        if isinstance(frame, InferenceResponseChunk):
            if not session.deliver_chunk(frame.request_id, frame.encrypted_data):
                session_lifecycle.distrust(session, "a response chunk did not open", services)
            await _relayed(session, frame.request_id)
        elif isinstance(frame, InferenceComplete):
            if not session.deliver_complete(frame.request_id, frame.usage):
                session_lifecycle.distrust(session, "it reported impossible token usage", services)
        elif isinstance(frame, InferenceError):
            session.deliver_error(frame.request_id, frame.status_code, frame.message, frame.param, frame.code)
        elif isinstance(frame, Heartbeat):
            session_lifecycle.on_heartbeat(services, session, frame)
        elif isinstance(frame, AttestationResponse):
            session_lifecycle.on_attestation_response(services, session, frame)
        elif isinstance(frame, Register):
            await strikes.strike("already_registered", "this session is already registered")
        # inference_accepted needs no action: the request is already counted on the session


async def _relayed(session: ProviderSession, request_id: str) -> None:
    """Let the loop run after each chunk frame, and read nothing more from this socket while one
    request has more chunks waiting than MAX_UNREAD_CHUNKS: a provider cannot pile chunks up faster
    than they are relayed (a backlog of millions of objects would stall the loop in garbage collection)."""
    await asyncio.sleep(0)
    while session.unread(request_id) > MAX_UNREAD_CHUNKS:
        session.last_frame_at = time.monotonic()  # it is this side that is not reading
        await asyncio.sleep(0.01)


async def _write_frames(websocket: WebSocket, link: SocketLink) -> None:
    """The session's only writer; a ``None`` in the outbox closes the socket with its code."""
    while True:
        frame = await link.outbox.get()
        if frame is None:
            await _close_quietly(websocket, link.close_code or 1000)
            return
        try:
            await websocket.send_text(frame)
        except Exception:  # noqa: BLE001 - a dead socket ends the writer; the reader cleans up
            return


async def _close_quietly(websocket: WebSocket, code: int) -> None:
    try:
        await websocket.close(code=code)
    except Exception:  # noqa: BLE001 - already closed
        pass
