"""The node's outbox: frames leave in order; the chunks of one request waiting side by side leave as
one sealed frame whose plaintext is an array of them (once the coordinator said it opens arrays); a
cancelled request's queued frames never go."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import pytest

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.outbox import (COALESCE_BYTES, COALESCE_CHUNKS, SPLIT_BYTES, WRITE_BYTES, BatchedWrites,
                                      Outbox)
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire import crypto, protocol


@dataclass(eq=False)
class Request:
    request_id: str
    cancelled: bool = False


class Socket:
    """Stands in for the connection and its protocol: records the frames each write carries; can hold
    the writer as it writes (as websockets' ``send_context`` waits for a full buffer to drain)."""

    def __init__(self) -> None:
        self.writes: list[list[Any]] = []
        self.gate: asyncio.Event | None = None
        self.protocol = self
        self._queued: list[Any] = []

    def send_text(self, data: bytes) -> None:
        self._queued.append(protocol.parse_provider_frame(data.decode()))

    @contextlib.asynccontextmanager
    async def send_context(self) -> AsyncIterator[None]:
        yield
        self.writes.append(self._queued)
        self._queued = []
        if self.gate is not None:
            await self.gate.wait()

    async def send(self, text: str) -> None:  # websockets' one-frame send: a write of its own
        async with self.send_context():
            self.send_text(text.encode())

    @property
    def sent(self) -> list[Any]:
        return [frame for write in self.writes for frame in write]


def chunk(text: str) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


async def drain(outbox: Outbox, socket: Socket) -> None:
    writer = asyncio.create_task(outbox.write_to(socket))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0)
    writer.cancel()


def opened(reply: crypto.ReplyKey, frame: protocol.InferenceResponseChunk) -> list[str]:
    return [c["choices"][0]["delta"]["content"] for c in response_chunks(reply.open(frame.encrypted_data))]


def sealer_for(reply: crypto.ReplyKey) -> crypto.Sealer:
    return crypto.Sealer(reply.public_key)


def merging() -> Outbox:
    outbox = Outbox()
    outbox.merge_chunks = True  # `registered.chunk_arrays` from this release's coordinator
    return outbox


async def test_waiting_chunks_of_a_request_leave_as_one_frame_in_order() -> None:
    outbox, socket = merging(), Socket()
    a, b = Request("a"), Request("b")
    reply_a, reply_b = crypto.ReplyKey(), crypto.ReplyKey()
    sealer_a, sealer_b = sealer_for(reply_a), sealer_for(reply_b)
    outbox.send(protocol.InferenceAccepted(request_id="a"), a)
    for word in ("one", "two", "three"):
        outbox.send_chunk(a, sealer_a, chunk(word))
    outbox.send_chunk(b, sealer_b, chunk("other"))
    outbox.send_chunk(a, sealer_a, chunk("four"))
    outbox.send(protocol.InferenceComplete(request_id="a", usage=protocol.Usage(prompt_tokens=1,
                                                                                completion_tokens=4)), a)
    await drain(outbox, socket)
    kinds = [(type(frame).__name__, frame.request_id) for frame in socket.sent]
    assert kinds == [("InferenceAccepted", "a"), ("InferenceResponseChunk", "a"), ("InferenceResponseChunk", "b"),
                     ("InferenceResponseChunk", "a"), ("InferenceComplete", "a")]
    assert opened(reply_a, socket.sent[1]) == ["one", "two", "three"]
    assert opened(reply_b, socket.sent[2]) == ["other"]
    # a lone chunk is sealed as the object itself, as a node that never merges would send it
    assert isinstance(json.loads(reply_a.open(socket.sent[3].encrypted_data)), dict)


async def test_the_frames_waiting_together_leave_in_one_write() -> None:
    """A request's last chunk and its `inference_complete` share a turn: one write, so the coordinator
    wakes once for both."""
    outbox, socket = Outbox(), Socket()
    request, reply = Request("a"), crypto.ReplyKey()
    outbox.send(protocol.InferenceAccepted(request_id="a"), request)
    await drain(outbox, socket)
    outbox.send_chunk(request, sealer_for(reply), chunk("last"))
    outbox.send(protocol.InferenceComplete(request_id="a", usage=protocol.Usage(prompt_tokens=1,
                                                                                completion_tokens=1)), request)
    await drain(outbox, socket)
    assert [[type(frame).__name__ for frame in write] for write in socket.writes] == [
        ["InferenceAccepted"], ["InferenceResponseChunk", "InferenceComplete"]]


async def test_a_turn_leaves_in_writes_of_about_write_bytes_and_a_cancel_between_them_drops_the_rest() -> None:
    """Past WRITE_BYTES the writer waits for the socket to drain before it makes the next frames, as it
    did between frames: a request cancelled meanwhile sends nothing more."""
    outbox, socket = Outbox(), Socket()
    kept, dropped = Request("kept"), Request("dropped")
    reply = crypto.ReplyKey()
    big = chunk("x" * (WRITE_BYTES // 2))
    for _ in range(3):
        outbox.send_chunk(dropped, sealer_for(reply), big)
    outbox.send_chunk(kept, sealer_for(reply), chunk("small"))
    socket.gate = asyncio.Event()
    writer = asyncio.create_task(outbox.write_to(socket))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)  # the first write (two frames) went; the writer waits for the drain
    dropped.cancelled = True
    socket.gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    writer.cancel()
    assert [[frame.request_id for frame in write] for write in socket.writes] == [["dropped", "dropped"], ["kept"]]


class _Transport:
    def __init__(self, tls: bool = False) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.tls = tls

    def writelines(self, data: list[bytes]) -> None:
        self.calls.append(("writelines", list(data)))

    def can_write_eof(self) -> bool:
        return not self.tls

    def write_eof(self) -> None:
        self.calls.append(("write_eof", []))

    def close(self) -> None:
        self.calls.append(("close", []))


class _Protocol:
    def __init__(self, data: list[bytes]) -> None:
        self.data = data

    def data_to_send(self) -> list[bytes]:
        return self.data


def test_a_connection_writes_what_its_protocol_queued_in_one_call_and_then_half_closes() -> None:
    connection = BatchedWrites.__new__(BatchedWrites)  # send_data needs only its transport and protocol
    transport = connection.transport = _Transport()  # type: ignore[assignment]
    connection.protocol = _Protocol([b"frame one", b"frame two"])  # type: ignore[assignment]
    connection.send_data()
    connection.protocol = _Protocol([b"close frame", b""])  # type: ignore[assignment]  # b"": end of the stream
    connection.send_data()
    assert transport.calls == [("writelines", [b"frame one", b"frame two"]), ("writelines", [b"close frame"]),
                               ("write_eof", [])]
    tls = connection.transport = _Transport(tls=True)  # type: ignore[assignment]  # no half-close over TLS
    connection.protocol = _Protocol([b"close frame", b""])  # type: ignore[assignment]
    connection.send_data()
    assert tls.calls == [("writelines", [b"close frame"]), ("close", [])]


async def test_a_chunk_sent_while_the_writer_is_idle_goes_alone() -> None:
    outbox, socket = Outbox(), Socket()
    request, reply = Request("a"), crypto.ReplyKey()
    sealer = sealer_for(reply)
    writer = asyncio.create_task(outbox.write_to(socket))  # type: ignore[arg-type]
    for word in ("one", "two"):
        outbox.send_chunk(request, sealer, chunk(word))
        for _ in range(3):
            await asyncio.sleep(0)
    writer.cancel()
    assert [opened(reply, frame) for frame in socket.sent] == [["one"], ["two"]]


async def test_chunks_queued_during_a_send_are_merged_and_a_cancel_drops_them() -> None:
    outbox, socket = merging(), Socket()
    kept, dropped = Request("kept"), Request("dropped")
    reply = crypto.ReplyKey()
    sealer = sealer_for(reply)
    socket.gate = asyncio.Event()
    writer = asyncio.create_task(outbox.write_to(socket))  # type: ignore[arg-type]
    outbox.send(protocol.InferenceAccepted(request_id="kept"), kept)
    await asyncio.sleep(0)  # the writer is inside that send now
    for word in ("a", "b"):
        outbox.send_chunk(kept, sealer, chunk(word))
        outbox.send_chunk(dropped, sealer, chunk(word))
    outbox.send_chunk(kept, sealer, chunk("c"))
    dropped.cancelled = True
    socket.gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    writer.cancel()
    assert [frame.request_id for frame in socket.sent] == ["kept", "kept", "kept", "kept"]
    assert [opened(reply, frame) for frame in socket.sent[1:]] == [["a"], ["b"], ["c"]]  # not adjacent


async def test_a_merged_frame_holds_at_most_coalesce_bytes_of_chunks() -> None:
    outbox, socket = merging(), Socket()
    request, reply = Request("a"), crypto.ReplyKey()
    sealer = sealer_for(reply)
    word = "x" * (COALESCE_BYTES // 5)
    for _ in range(12):
        outbox.send_chunk(request, sealer, chunk(word))
    await drain(outbox, socket)
    sizes = [len(opened(reply, frame)) for frame in socket.sent]
    assert sum(sizes) == 12 and len(sizes) >= 3 and max(sizes) <= 4


async def test_nothing_is_queued_on_a_closed_outbox_or_for_a_cancelled_request() -> None:
    outbox, socket = Outbox(), Socket()
    request, reply = Request("a", cancelled=True), crypto.ReplyKey()
    outbox.send_chunk(request, sealer_for(reply), chunk("late"))
    outbox.close()
    outbox.send_chunk(Request("b"), sealer_for(reply), chunk("later"))
    await drain(outbox, socket)
    assert socket.sent == []


async def test_a_coordinator_that_did_not_say_it_opens_arrays_gets_one_chunk_per_frame() -> None:
    outbox, socket = Outbox(), Socket()  # an older coordinator: `registered` without chunk_arrays
    request, reply = Request("a"), crypto.ReplyKey()
    sealer = sealer_for(reply)
    for word in ("one", "two", "three"):
        outbox.send_chunk(request, sealer, chunk(word))
    await drain(outbox, socket)
    assert [json.loads(reply.open(frame.encrypted_data))["choices"][0]["delta"]["content"]
            for frame in socket.sent] == ["one", "two", "three"]


def vectors(count: int, size: int = 576) -> dict[str, Any]:
    """An embeddings answer as one chunk (what an upstream's /v1/embeddings becomes): ~14 KB a vector."""
    return {"id": "e", "object": "list", "model": "m",
            "data": [{"object": "embedding", "index": i, "embedding": [0.123456789012345 + i] * size}
                     for i in range(count)]}


async def test_a_list_chunk_over_a_mebibyte_leaves_in_parts_of_the_same_shape() -> None:
    """Issue 19 row 4: ~700 of the bundled model's vectors (~11 MB) were one frame over the
    coordinator's 8 MiB limit."""
    outbox, socket, reply = merging(), Socket(), crypto.ReplyKey()
    answer = vectors(1000)
    assert len(json.dumps(answer)) > protocol.MAX_FRAME_BYTES
    outbox.send_chunk(Request("r1"), sealer_for(reply), answer)
    await drain(outbox, socket)
    plaintexts = [reply.open(frame.encrypted_data) for frame in socket.sent]
    parts = [response_chunks(plaintext) for plaintext in plaintexts]
    assert len(parts) >= 10 and all(len(plaintext) <= SPLIT_BYTES + 100 for plaintext in plaintexts)
    indices = []
    for [part] in parts:  # each frame one chunk: none is merged past 64 KiB
        assert {k: v for k, v in part.items() if k != "data"} == {"id": "e", "object": "list", "model": "m"}
        indices += [item["index"] for item in part["data"]]
    assert indices == list(range(1000))


async def test_a_chunk_too_large_for_any_frame_fails_its_request() -> None:
    outbox = merging()
    huge = chunk("x" * (protocol.MAX_FRAME_BYTES * 3 // 4))
    with pytest.raises(BackendError) as info:
        outbox.send_chunk(Request("r1"), sealer_for(crypto.ReplyKey()), huge)
    assert info.value.status_code == 502
    with pytest.raises(BackendError):  # one vector too large alone
        outbox.send_chunk(Request("r2"), sealer_for(crypto.ReplyKey()), vectors(1, 400_000))


async def test_frame_sizes_are_counted_in_bytes_not_characters() -> None:
    """Non-ASCII text is written as UTF-8: 4 million "é" are 8 MB, too large for a frame although
    fewer characters than a frame holds."""
    text = "é" * 4_000_000
    assert protocol.sealed_frame_bytes(len(text)) < protocol.MAX_FRAME_BYTES
    with pytest.raises(BackendError) as info:
        merging().send_chunk(Request("r1"), sealer_for(crypto.ReplyKey()), chunk(text))
    assert info.value.status_code == 502


async def test_no_more_than_coalesce_chunks_share_a_frame() -> None:
    outbox, socket, reply = merging(), Socket(), crypto.ReplyKey()
    request = Request("r1")
    for _ in range(COALESCE_CHUNKS + 10):
        outbox.send_chunk(request, sealer_for(reply), {"i": 1})
    await drain(outbox, socket)
    assert [len(response_chunks(reply.open(f.encrypted_data))) for f in socket.sent] == [COALESCE_CHUNKS, 10]
