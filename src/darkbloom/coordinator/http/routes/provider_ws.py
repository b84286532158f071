"""WebSocket endpoint the provider nodes dial into (docs/protocol.md "Frames"): accepted here and handed
to its ``ProviderConnection`` (``fleet/connection.py``), which reads, writes and closes it.

``ProviderSocketFirst`` serves it from the top of the app's middleware stack: a node's socket lives
for hours, none of the HTTP layers (CORS, body limits, exception handlers, routing, dependency
solving) applies to it, and what they keep per connection was a fifth of a connected node's memory
(bench/fleet_scale.py; bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable

from fastapi import WebSocket
from starlette.types import ASGIApp, Receive, Scope, Send

from darkbloom.coordinator.fleet.connection import ProviderConnection, close_quietly
from darkbloom.coordinator.fleet.registration_gate import TRY_AGAIN_LATER
from darkbloom.coordinator.services import Services

PATH = "/ws/provider"


class ProviderSocketFirst:
    """ASGI middleware, the app's outermost: ``PATH`` as a WebSocket goes straight to
    ``provider_socket``; everything else to the app. It hands back the coroutine that serves the
    connection rather than awaiting it, so no request runs through a frame of its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] == "websocket" and scope["path"] == PATH:
            return provider_socket(WebSocket(scope, receive, send))
        return self.app(scope, receive, send)


async def provider_socket(websocket: WebSocket) -> None:
    """Accept; with too many registrations in flight close at once (1013), else hand the socket over."""
    services: Services = websocket.app.state.services
    await websocket.accept()
    registering = services.registrations.enter()
    if registering is None:
        await close_quietly(websocket, TRY_AGAIN_LATER)
        return
    try:
        await ProviderConnection(services, websocket).serve(registering)
    except asyncio.CancelledError:
        # only the server's shutdown cancels a socket's handler (past its grace): the session was taken
        # down on the way out of serve and the socket is closed; a traceback per socket would say nothing
        pass
    finally:
        registering.done()
