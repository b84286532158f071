"""A tiny fake coordinator WebSocket endpoint for node tests (not the real coordinator: the e2e
tests drive that one). Each accepted connection is handed to the test, which scripts both sides."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, NoReturn

from pydantic import BaseModel
from websockets.asyncio.server import Server, ServerConnection, serve

from darkbloom.provider.config import load_config
from darkbloom.provider.node import ProviderNode
from darkbloom.provider.reconnect import ReconnectPolicy
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import crypto, protocol
from tests.support.backends import BackendCall, MockBackend


class Conn:
    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws
        self.frames: list[Any] = []  # every frame received, heartbeats included

    async def recv(self, timeout: float = 30) -> Any:
        frame = protocol.parse_provider_frame(await asyncio.wait_for(self.ws.recv(), timeout))
        self.frames.append(frame)
        return frame

    async def recv_type(self, kind: type, timeout: float = 30) -> Any:
        """The next frame of `kind`, skipping heartbeats; any other frame fails the test."""
        while True:
            frame = await self.recv(timeout)
            if isinstance(frame, kind):
                return frame
            assert isinstance(frame, protocol.Heartbeat), f"expected {kind.__name__}, got {frame!r}"

    async def recv_chunks(self, reply_key: crypto.ReplyKey, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """At least `count` response chunks, opened (a frame may carry several: docs/protocol.md)."""
        chunks: list[dict[str, Any]] = []
        while len(chunks) < count:
            frame = await self.recv_type(protocol.InferenceResponseChunk, timeout)
            chunks.extend(response_chunks(reply_key.open(frame.encrypted_data)))
        return chunks

    async def send(self, frame: BaseModel | dict[str, Any]) -> None:
        await self.ws.send(json.dumps(frame) if isinstance(frame, dict) else protocol.dump(frame))


class FakeCoordinator:
    def __init__(self) -> None:
        self.connections: asyncio.Queue[Conn] = asyncio.Queue()
        self.paths: list[str] = []
        self._server: Server | None = None

    async def __aenter__(self) -> "FakeCoordinator":
        self._server = await serve(self._handler, "127.0.0.1", 0, max_size=protocol.MAX_FRAME_BYTES)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = next(iter(self._server.sockets)).getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.paths.append(ws.request.path)
        await self.connections.put(Conn(ws))
        await ws.wait_closed()

    async def accept(self, timeout: float = 60) -> Conn:
        return await asyncio.wait_for(self.connections.get(), timeout)


def no_inference(call: BackendCall) -> NoReturn:
    """The `MockBackend` handler for tests where no inference happens."""
    raise AssertionError(f"no inference expected, got a {call.api} request")


@contextlib.asynccontextmanager
async def running_node(url: str, home: Path, policy: ReconnectPolicy) -> AsyncIterator[ProviderNode]:
    """A node (idle backend, heartbeats every 0.2 s) dialling ``url`` until the block ends."""
    config = load_config(home, {"coordinator_url": url})
    config.heartbeat_interval_secs = 0.2
    node = ProviderNode(config, home, MockBackend(no_inference), reconnect=policy)
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    try:
        yield node
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
