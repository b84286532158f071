"""The coordinator's WebSocket protocol: uvicorn's sans-I/O websockets protocol, with the small frames
an idle node sends all day read in place.

Every node sends a heartbeat every 5 s and its websockets client pings every 20 s: at 10,000 nodes,
2,500 frames a second from a fleet doing nothing. websockets' parser (generators per frame, an enum
and a ``Frame`` for each) was the largest part of what such a frame cost the coordinator, so a
complete, unfragmented, masked text frame of at most ``SMALL_FRAME`` bytes, and a ping, are read
here as RFC 6455 lays them out; every other frame goes to websockets, which also answers what is
wrong with it.

This side sits in front of websockets and frames the stream itself: it hands websockets whole
frames' bytes only (a frame it passes on, it passes on to its last byte before it reads the next
header), and it knows whether websockets is assembling a fragmented message, so it knows without
looking inside websockets that websockets waits for the start of a frame when it reads one here.
Only websockets' public sans-I/O API is needed (``Protocol.receive_data``, ``Protocol.state``); its C
unmasking is used when it is there, else the same XOR in Python.
A client that sends frames before the handshake's answer (pipelined behind its request) has every
byte read by websockets. The subclass reads uvicorn's protocol attributes (the queue, the pause, the
transport), which is why pyproject.toml bounds uvicorn; tests/coordinator/test_websocket_protocol.py
drives it against a real uvicorn and websockets.

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
from websockets.http11 import Request
from websockets.protocol import State
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

SMALL_FRAME = 16 * 1024  # payload bytes read here at most; a heartbeat is ~100
PAUSE_AT = 4  # messages queued for the app before reading pauses
REPEATS = "darkbloom.repeats"  # the scope extension: this connection's Repeats
# RFC 6455 section 5.2
_FIN = 0x80
_RSV = 0x70  # set only by an extension (a compressed frame): websockets' to read
_MASKED = 0x80
_MAX_CONTROL = 125
OP_CONT, OP_TEXT, OP_BINARY, OP_PING = 0x0, 0x1, 0x2, 0x9
_END_OF_REQUEST = b"\r\n\r\n"


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
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.repeats = Repeats()
        self._before_handshake: list[bytes] | None = []  # the request's bytes, until the handshake ends
        self._in_step = True   # False: a client pipelined frames, and websockets reads every byte
        self._pending = b""    # the start of a frame not yet complete, held at a frame boundary
        self._owed = 0         # bytes of the frame websockets is reading that it has not been given yet
        self._fragmented = False  # websockets is assembling a message from fragments

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if self.handshake_initiated and not self.close_sent:
            self.scope["extensions"][REPEATS] = self.repeats  # before the app's task first runs

    def data_received(self, data: bytes) -> None:
        if not self.handshake_complete:
            self._note_request_bytes(data)
            super().data_received(data)
            return
        self._before_handshake = None
        if not self._in_step or self.close_sent or self.conn.state is not State.OPEN:
            if self._pending:
                data, self._pending = self._pending + data, b""
            super().data_received(data)
            return
        if self._pending:
            data, self._pending = self._pending + data, b""
        self._read(data)

    def _note_request_bytes(self, data: bytes) -> None:
        """Whether anything follows the upgrade request before the handshake ends: then websockets
        holds bytes of frames, and this side never reads one."""
        if self._before_handshake is None:
            return
        if self.handshake_initiated:  # the request was read: these are frames sent ahead of the answer
            self._in_step, self._before_handshake = False, None
            return
        self._before_handshake.append(data)
        received = b"".join(self._before_handshake)
        end = received.find(_END_OF_REQUEST)
        if end != -1:
            self._in_step = end + len(_END_OF_REQUEST) == len(received)
            self._before_handshake = None if not self._in_step else []

    def _read(self, data: bytes) -> None:
        """Deliver the small text frames and answer the pings in ``data``; hand every other frame's
        bytes to websockets in order, and keep an incomplete frame's start for the next call."""
        start, end = 0, len(data)
        passed: list[bytes] = []
        while start < end:
            if self._owed:
                step = min(self._owed, end - start)
                passed.append(data[start:start + step])
                self._owed -= step
                start += step
                continue
            frame = _frame_header(data, start, end)
            if frame is None:
                self._pending = data[start:]
                break
            first, opcode, masked, length, header = frame
            small = (not first & _RSV and first & _FIN and masked
                     and ((opcode == OP_TEXT and not self._fragmented and length <= SMALL_FRAME)
                          or (opcode == OP_PING and length <= _MAX_CONTROL)))
            text = None
            if small:
                self._flush(passed)  # what websockets was given may have closed the connection
                small = not self.close_sent and self.conn.state is State.OPEN
            if small:
                stop = start + header + length
                if stop > end:
                    self._pending = data[start:]
                    break
                payload = _unmask(data[start + header:stop], data[start + header - 4:start + header])
                if opcode == OP_PING:
                    self.transport.write(bytes((0x80 | 0xA, length)) + payload)  # the pong websockets would send
                    start = stop
                    continue
                try:
                    text = payload.decode()
                except UnicodeDecodeError:
                    pass  # websockets closes with 1007
            if text is not None:
                start += header + length
                self._deliver(text)
                continue
            if opcode in (OP_TEXT, OP_BINARY):
                self._fragmented = not first & _FIN
            elif opcode == OP_CONT and first & _FIN:
                self._fragmented = False
            self._owed = header + length
        self._flush(passed)

    def _flush(self, passed: list[bytes]) -> None:
        if passed:
            super().data_received(b"".join(passed))
            passed.clear()

    def _deliver(self, text: str) -> None:
        if self.repeats.swallows(text):
            return
        self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if not self.read_paused and self.queue.qsize() >= PAUSE_AT:
            self.read_paused = True
            self.transport.pause_reading()


def _frame_header(data: bytes, start: int, end: int) -> tuple[int, int, bool, int, int] | None:
    """The frame at ``start``: its first byte, opcode, mask bit, payload length and header length
    (mask key included); None until the whole header has arrived."""
    if end - start < 2:
        return None
    first, second = data[start], data[start + 1]
    length, header = second & 0x7F, 2
    if length == 126:
        if end - start < 4:
            return None
        length, header = int.from_bytes(data[start + 2:start + 4], "big"), 4
    elif length == 127:
        if end - start < 10:
            return None
        length, header = int.from_bytes(data[start + 2:start + 10], "big"), 10
    masked = bool(second & _MASKED)
    if masked:
        header += 4
        if end - start < header:
            return None
    return first, first & 0x0F, masked, length, header


def _xor_mask(payload: bytes, mask: bytes) -> bytes:
    """RFC 6455 5.3: the payload XOR the 4-byte mask repeated, as one integer operation."""
    if not payload:
        return payload
    size = len(payload)
    key = (mask * (size // 4 + 1))[:size]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(size, "big")


try:  # websockets' C unmasking (13.0 to 17.4 have it; not public API, so a release without it only costs time)
    from websockets.speedups import apply_mask as _unmask
except ImportError:  # pragma: no cover - a websockets built without its C extension
    _unmask = _xor_mask
