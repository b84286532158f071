"""Running direct mode inside the node's event loop: token, listening socket, uvicorn, `local.json`.

`open()` (before the model loads, so a taken port fails fast) reads or creates the token and binds
the socket; `start()` serves on it and writes `local.json`; `stop()` removes `local.json` and stops
the server. The token is mandatory: direct mode has no unauthenticated mode, on loopback or not.
Binding a non-loopback address (`--bind 0.0.0.0`) is allowed only because of that, and is logged.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
from pathlib import Path

import uvicorn

from darkbloom.http_server import Server
from darkbloom.wire import local_files
from darkbloom.paths import local_discovery_path, local_token_path
from darkbloom.provider.backends import Backend
from darkbloom.provider.config import ProviderConfig
from darkbloom.provider.direct.server import create_app
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)


class LocalEndpointError(Exception):
    """Direct mode cannot start; the message says what to change."""


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class LocalEndpoint:
    def __init__(self, config: ProviderConfig, home: Path, backend: Backend, slots: Slots) -> None:
        self.config, self.home, self.backend, self.slots = config, home, backend, slots
        self.token = ""
        self.host = ""
        self.port = 0
        self._socket: socket.socket | None = None
        self._server: Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def open(self) -> None:
        bind = self.config.local_bind.strip()
        try:
            self.token = local_files.load_or_create_local_token(self.home)
        except local_files.LocalTokenError as exc:
            where = "" if is_loopback(bind) else f" (and {bind} is not a loopback address)"
            raise LocalEndpointError(f"refusing to serve direct mode without its token{where}: {exc}") from None
        self._socket = _listen(bind, self.config.local_port)
        address = self._socket.getsockname()
        self.host = _connectable(address[0])
        self.port = int(address[1])
        if not is_loopback(bind):
            log.warning("direct mode listens on %s:%d, reachable from other machines; every request needs the "
                        "token in %s", bind, self.port, local_token_path(self.home))

    async def start(self) -> None:
        if self._socket is None:
            self.open()
        assert self._socket is not None
        app = create_app(self.backend, self.slots, self.config.model_ids, self.token,
                         max_body_bytes=self.config.max_body_bytes)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=3)
        self._server = Server(config, own_signals=False)  # the node owns SIGINT / SIGTERM
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="direct-mode")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise LocalEndpointError("direct mode stopped while starting")
            await asyncio.sleep(0.01)
        local_files.write_discovery(self.home, local_files.Discovery(
            base_url=self.base_url, api_key=self.token, host=self.host, port=self.port, pid=os.getpid()))
        log.info("direct mode at %s (token in %s, discovery in %s)", self.base_url, local_token_path(self.home),
                 local_discovery_path(self.home))

    async def stop(self) -> None:
        local_files.remove_discovery(self.home, os.getpid())
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
                self._server.force_exit = True
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        log.info("direct mode stopped")


def _listen(bind: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise LocalEndpointError(f"direct-mode bind address {bind!r} is not an address or host name this machine "
                                 "knows; use --bind 127.0.0.1 (or [local] bind in provider.toml)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LocalEndpointError(f"port {port} on {bind} is already in use (another node's direct mode?); "
                                     "pick another with --port (or [local] port in provider.toml)") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise LocalEndpointError(f"{bind} is not an address of this machine; use --bind 127.0.0.1 "
                                     "or one of this machine's addresses") from None
        raise LocalEndpointError(f"cannot listen on {bind}:{port} for direct mode: {exc.strerror or exc}") from None
    return sock


def _connectable(host: str) -> str:
    """The address a client on this machine uses to reach a socket bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
