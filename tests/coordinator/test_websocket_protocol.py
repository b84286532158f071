"""The coordinator's WebSocket protocol (``websocket_protocol.py``) behind a real uvicorn server:
small text frames and pings are read in place and everything else by websockets, with the same
messages in the same order either way; a muted text's repeats reach the app only as their arrival
time; and what is not a well-formed small frame gets websockets' own answer (the close code)."""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any, AsyncIterator

import pytest
import uvicorn
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.server import ServerProtocol

from darkbloom.coordinator.websocket_protocol import SMALL_FRAME, SmallFrameWebSocketProtocol, mute_repeats

MUTED = "hb"  # texts starting with this are muted by the app once read


class App:
    """Records every message; mutes texts starting with MUTED for ``mute_seconds``; answers "sync?"."""

    def __init__(self) -> None:
        self.received: list[str | bytes] = []
        self.repeats: list[float] = []
        self.mute_seconds = 60.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return
        websocket = WebSocket(scope, receive, send)
        if scope["path"] == "/slow":
            await asyncio.sleep(0.3)  # frames sent meanwhile reach the server before its answer
        await websocket.accept()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message["text"] if message.get("text") is not None else message["bytes"]
            if data == "sync?":
                await websocket.send_text("sync")
                continue
            self.received.append(data)
            if isinstance(data, str) and data.startswith(MUTED):
                mute_repeats(websocket, data, self.mute_seconds, self.repeats.append)


@pytest.fixture
async def served() -> AsyncIterator[tuple[App, str]]:
    app = App()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, ws=SmallFrameWebSocketProtocol,
                                           ws_ping_interval=None, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, f"ws://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
def parsed_by_websockets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts websockets' parser was given after the handshake."""
    fed: list[int] = []
    real = ServerProtocol.receive_data

    def counted(self: ServerProtocol, data: bytes) -> None:
        if self.state.name == "OPEN":
            fed.append(len(data))
        real(self, data)

    monkeypatch.setattr(ServerProtocol, "receive_data", counted)
    return fed


async def _sync(client: Any) -> None:
    await client.send("sync?")
    assert await client.recv() == "sync"


async def test_small_frames_and_pings_never_reach_websockets(served: tuple[App, str],
                                                             parsed_by_websockets: list[int]) -> None:
    app, url = served
    sent = ["", "a", "é" * 62, "x" * 125, "y" * 126, "z" * 4000, "w" * SMALL_FRAME,
            '{"type":"heartbeat","status":"idle","active_requests":0,"models":["m"]}']
    async with connect(url, compression=None, ping_interval=None) as client:
        for text in sent:
            await client.send(text)
            pong = await client.ping(os.urandom(4))
            await asyncio.wait_for(pong, 5)
        await _sync(client)
        assert parsed_by_websockets == [], "a small frame or a ping went through websockets' parser"
    assert app.received == sent
    assert parsed_by_websockets, "the close frame went to websockets"


async def test_everything_else_arrives_as_sent_in_order(served: tuple[App, str],
                                                        parsed_by_websockets: list[int]) -> None:
    app, url = served
    async with connect(url, compression=None, ping_interval=None, max_size=None) as client:
        await client.send("small before")
        await client.send("v" * (SMALL_FRAME + 1))    # over the small-frame bound
        await client.send("q" * 70_000)                # a 64-bit length
        await client.send(b"\x00\x01binary")           # binary
        await client.send(["frag", "mented", " text"])  # fragmented
        await client.send("small after")
        await _sync(client)
    assert app.received == ["small before", "v" * (SMALL_FRAME + 1), "q" * 70_000, b"\x00\x01binary",
                            "fragmented text", "small after"]
    assert parsed_by_websockets, "the frames that are not small went to websockets"


async def test_a_muted_text_repeats_only_as_its_arrival(served: tuple[App, str]) -> None:
    app, url = served
    async with connect(url, compression=None, ping_interval=None) as client:
        await client.send("hb 1")
        await _sync(client)  # read and muted
        for _ in range(3):
            await client.send("hb 1")
        await client.send("other")
        await client.send("hb 2")  # another text: delivered, and now the muted one
        await _sync(client)
        await client.send("hb 1")  # no longer muted
        await _sync(client)
        app.mute_seconds = 0.2
        await client.send("hb 3")
        await _sync(client)
        await asyncio.sleep(0.3)   # the mute has ended: delivered again
        await client.send("hb 3")
        await _sync(client)
    assert app.received == ["hb 1", "other", "hb 2", "hb 1", "hb 3", "hb 3"]
    assert len(app.repeats) == 3 and app.repeats == sorted(app.repeats)


def _frame(first: int, payload: bytes, masked: bool = True) -> bytes:
    mask = b"\x5a\x0f\xa5\xf0"
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if masked else payload
    length = bytes((len(payload),)) if len(payload) < 126 else bytes((126,)) + len(payload).to_bytes(2, "big")
    return bytes((first, (0x80 if masked else 0) | length[0])) + length[1:] + (mask if masked else b"") + body


@pytest.mark.parametrize("frame, close_code", [
    (_frame(0x81, b"unmasked", masked=False), 1002),   # a client frame must be masked
    (_frame(0x81, b"\xff\xfe not utf-8"), 1007),        # invalid UTF-8 text
    (_frame(0xC1, b"compressed?"), 1002),               # RSV1 without the extension
    (_frame(0x01, b"no FIN") + _frame(0x81, b"then a new message"), 1002),  # a new message mid-fragment
    (_frame(0x89, b"p" * 126), 1002),                   # a ping over 125 bytes
], ids=["unmasked", "invalid utf-8", "rsv1", "new message mid-fragment", "long ping"])
async def test_frames_that_are_not_small_and_well_formed_get_websockets_answer(
        served: tuple[App, str], frame: bytes, close_code: int) -> None:
    app, url = served
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1].rstrip("/")))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    assert b" 101 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.write(_frame(0x81, b"first") + frame)
    header = await asyncio.wait_for(reader.readexactly(2), 5)
    assert header[0] == 0x88, header  # a close frame
    body = await reader.readexactly(header[1] & 0x7F)
    assert int.from_bytes(body[:2], "big") == close_code
    writer.close()
    assert app.received == ["first"]


async def _raw_upgrade(url: str, *, path: str = "/", ahead: bytes = b""
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hand-made client: the upgrade request, ``ahead`` a moment later (frames sent before the
    answer), and the 101 read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1].rstrip("/")))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    if ahead:
        await asyncio.sleep(0.1)
        writer.write(ahead)
    assert b" 101 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return reader, writer


async def _until_received(app: App, count: int) -> None:
    for _ in range(500):
        if len(app.received) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"received {app.received}")


async def test_frames_pipelined_behind_the_request_are_all_websockets(
        served: tuple[App, str], parsed_by_websockets: list[int]) -> None:
    app, url = served
    reader, writer = await _raw_upgrade(url, path="/slow", ahead=_frame(0x81, b"sent ahead"))
    writer.write(_frame(0x81, b"after the answer"))
    await _until_received(app, 2)
    assert app.received == ["sent ahead", "after the answer"]
    assert parsed_by_websockets, "a connection out of step read a frame in place"
    writer.close()


async def test_a_frame_in_pieces_and_a_ping_inside_a_fragmented_message_keep_their_order(
        served: tuple[App, str], parsed_by_websockets: list[int]) -> None:
    app, url = served
    reader, writer = await _raw_upgrade(url)
    for byte in _frame(0x81, b"one byte at a time"):
        writer.write(bytes((byte,)))
        await writer.drain()
    await _until_received(app, 1)
    assert parsed_by_websockets == []  # read in place, from every piece
    writer.write(_frame(0x01, b"frag") + _frame(0x89, b"ping!") + _frame(0x80, b"mented"))
    header = await asyncio.wait_for(reader.readexactly(2), 5)
    body = await reader.readexactly(header[1] & 0x7F)
    assert (header, body) == (bytes((0x8A, 5)), b"ping!"), (header, body)  # answered mid-message
    writer.write(_frame(0x81, b"last"))
    await _until_received(app, 3)
    assert app.received == ["one byte at a time", "fragmented", "last"]
    writer.close()


def test_the_python_unmasking_is_websockets_own() -> None:
    from websockets.utils import apply_mask

    from darkbloom.coordinator.websocket_protocol import _xor_mask
    for size in (0, 1, 3, 4, 5, 125, 126, 4000, SMALL_FRAME):
        payload, mask = os.urandom(size), os.urandom(4)
        assert _xor_mask(payload, mask) == apply_mask(payload, mask)
