"""The coordinator's WebSocket protocol: uvicorn's sans-I/O websockets protocol, with the small frames
an idle node sends all day read in place.

Every node sends a heartbeat every 5 s and its websockets client pings every 20 s: at 10,000 nodes,
2,500 frames a second from a fleet doing nothing. websockets' parser (generators per frame, an enum
and a ``Frame`` for each) was the largest part of what such a frame cost the coordinator, so a
complete, unfragmented, masked text frame of at most ``SMALL_FRAME`` bytes, and a ping, are read
here as RFC 6455 lays them out; anything else, and any frame that is not exactly that, goes to
websockets as before, which also answers what is wrong with it. This side reads only while
websockets' parser waits for the first byte of a frame, so the two never share a frame. That check
reads websockets' parser (its generators) and the rest uvicorn's queue: where a release changes
them, every frame goes to websockets, and tests/coordinator/test_websocket_protocol.py says so.

Each message is queued for the app as uvicorn queues it; reading pauses once ``PAUSE_AT`` wait
unread (uvicorn pauses at the first: a pause and a resume per frame), so a node that sends faster
than the app reads is still held back.

A node's heartbeats repeat the same text for as long as nothing changes on it. The app may ``mute``
a text it has just read and judged (``scope["extensions"][REPEATS]``): for ``seconds``, an identical
text is not queued again, only counted (``on_repeat``, the frame's arrival), so an idle session wakes
the app once per mute rather than once per heartbeat. A different text, or the same one once the mute
ends, is delivered as any other.
"""

from __future__ import annotations

import time
from typing import Callable

from starlette.websockets import WebSocket
from websockets.frames import OP_PING, OP_TEXT, apply_mask  # websockets' C speedup when built, else its Python
from websockets.http11 import Request
from websockets.protocol import OPEN, Protocol
from websockets.server import ServerProtocol
from websockets.streams import StreamReader
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

SMALL_FRAME = 16 * 1024  # payload bytes read here at most; a heartbeat is ~100
PAUSE_AT = 4  # messages queued for the app before reading pauses
_FIN = 0x80
_RSV = 0x70  # set only by an extension (a compressed frame): websockets' to read
_MASKED = 0x80
_MAX_CONTROL = 125
REPEATS = "darkbloom.repeats"  # the scope extension: this connection's Repeats
_FRAME_LOOP = Protocol.parse.__code__
_WAITING = StreamReader.at_eof.__code__


class Repeats:
    """The one text of a connection that is not delivered again while it repeats (see the module)."""

    __slots__ = ("text", "until", "on_repeat")

    def __init__(self) -> None:
        self.text: str | None = None
        self.until = 0.0
        self.on_repeat: Callable[[float], None] = _nothing

    def mute(self, text: str, seconds: float, on_repeat: Callable[[float], None]) -> None:
        self.text, self.until, self.on_repeat = text, time.monotonic() + seconds, on_repeat

    def swallows(self, text: str) -> bool:
        """Whether ``text`` is a muted repeat (``on_repeat`` is told when it arrived)."""
        if text != self.text:
            return False
        now = time.monotonic()
        if now >= self.until:
            self.text = None
            return False
        self.on_repeat(now)
        return True


def mute_repeats(websocket: WebSocket, text: str, seconds: float, on_repeat: Callable[[float], None]) -> None:
    """For ``seconds``, repeats of ``text`` on this socket only call ``on_repeat`` with the monotonic
    time they arrived (nothing under another server, which has no such extension)."""
    repeats = websocket.scope.get("extensions", {}).get(REPEATS)
    if repeats is not None:
        repeats.mute(text, seconds, on_repeat)


def _nothing(_at: float) -> None:
    pass


class SmallFrameWebSocketProtocol(WebSocketsSansIOProtocol):
    def handle_connect(self, event: Request) -> None:
        self.repeats = Repeats()
        super().handle_connect(event)
        if self.handshake_initiated and not self.close_sent:
            self.scope["extensions"][REPEATS] = self.repeats  # before the app's task first runs

    def data_received(self, data: bytes) -> None:
        if self.handshake_complete and not self.close_sent and _at_frame_start(self.conn):
            data = self._read_small_frames(data)
            if not data:
                return
        super().data_received(data)

    def _read_small_frames(self, data: bytes) -> bytes:
        """Deliver the small text frames and answer the pings at the start of ``data``; what is left
        (from the first frame that is anything else, or incomplete) is websockets' to read."""
        start, end = 0, len(data)
        while end - start >= 6:
            first, second = data[start], data[start + 1]
            if first & _RSV or not first & _FIN or not second & _MASKED:
                break
            opcode, length, header = first & 0x0F, second & 0x7F, 6
            if length == 126:
                if end - start < 8:
                    break
                length, header = int.from_bytes(data[start + 2:start + 4], "big"), 8
            elif length == 127:
                break
            stop = start + header + length
            if length > SMALL_FRAME or stop > end or opcode not in (OP_TEXT, OP_PING) \
                    or (opcode == OP_PING and length > _MAX_CONTROL):
                break
            payload = apply_mask(data[start + header:stop], data[start + header - 4:start + header])
            if opcode == OP_TEXT:
                try:
                    text = payload.decode()
                except UnicodeDecodeError:
                    break  # websockets closes with 1007
                start = stop
                if self.repeats.swallows(text):
                    continue
                self.queue.put_nowait({"type": "websocket.receive", "text": text})
                if not self.read_paused and self.queue.qsize() >= PAUSE_AT:
                    self.read_paused = True
                    self.transport.pause_reading()
            else:  # the pong websockets would send: FIN, opcode 0xA, the ping's payload, unmasked
                self.transport.write(bytes((0x8A, length)) + payload)
                start = stop
        return data[start:]


def _at_frame_start(conn: ServerProtocol) -> bool:
    """Whether websockets' parser waits for the first byte of a frame: open, no fragmented message
    under way, nothing buffered, its frame loop suspended where it asks whether more data comes."""
    if conn.state is not OPEN or conn.current_size is not None or conn.reader.buffer:
        return False
    waiting = conn.parser
    while waiting is not None and waiting.gi_code is not _FRAME_LOOP:
        waiting = waiting.gi_yieldfrom
    if waiting is None:
        return False
    waiting = waiting.gi_yieldfrom
    return waiting is not None and waiting.gi_code is _WAITING
