"""The frames waiting for one coordinator connection's writer, the only task that sends on it, so
concurrent requests never interleave writes. Once the connection is gone the outbox is closed and
takes nothing more.

Response chunks are queued in the clear with their request's sealer and sealed by the writer: the
chunks of one request that are waiting side by side when the writer gets to them leave as one
``inference_response_chunk`` whose sealed plaintext is a JSON array of them (docs/protocol.md), when
the coordinator said in ``registered`` that it opens arrays (``chunk_arrays``). A
model that makes one token at a time never waits here, so its chunks go one per frame as before;
an upstream that answers in one burst, or a writer behind under load, sends a few frames instead of
one per token — fewer seals, frames and parses on both sides, the same bytes to the client.

No frame is ever over the coordinator's limit: a list chunk (embeddings) over SPLIT_BYTES is split
into chunks of the same shape, each with part of its `data` (at most SPLIT_BYTES each, or one
item); any other chunk too large for one frame fails its request (502) instead of being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection

from darkbloom.provider.backends.base import BackendError
from darkbloom.wire import crypto, json_codec, protocol

COALESCE_BYTES = 64 * 1024  # plaintext of chunks merged into one frame, at most (a larger chunk goes alone)
COALESCE_CHUNKS = 1024  # and at most this many chunks
SPLIT_BYTES = 1024 * 1024  # a list chunk over this is sent as several, each with part of its data
WRITE_BYTES = 64 * 1024  # frames written at once before the writer waits for the socket to drain


class _Request(Protocol):
    request_id: str
    cancelled: bool


@dataclass(frozen=True)
class _Chunk:
    request: _Request
    sealer: crypto.Sealer
    data: bytes  # the chunk's compact JSON, UTF-8: every size here is of these bytes


class Outbox:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[_Request | None, str] | _Chunk] = asyncio.Queue()
        self.closed = False
        self.merge_chunks = False  # set from `registered.chunk_arrays`: only a coordinator that opens arrays gets them

    def send(self, frame: BaseModel, request: _Request | None = None) -> None:
        """Queue `frame`. One queued with its request is dropped if the request is cancelled before it
        goes; one queued with None (not a request's, or the usage report after a cancel) always goes."""
        if not self.closed and (request is None or not request.cancelled):
            self._queue.put_nowait((request, protocol.dump(frame)))

    def send_chunk(self, request: _Request, sealer: crypto.Sealer, chunk: dict[str, Any]) -> None:
        """Queue one response chunk of `request`, to be sealed with `sealer` when it goes (split when it
        is a list over SPLIT_BYTES; BackendError 502 when it cannot fit a frame)."""
        if self.closed or request.cancelled:
            return
        data = json_codec.dumps(chunk)
        parts = _split(chunk) if len(data) > SPLIT_BYTES else [data]
        if any(protocol.sealed_frame_bytes(len(part)) > protocol.MAX_FRAME_BYTES for part in parts):
            raise BackendError(502, "the backend sent a chunk too large to relay")
        for part in parts:
            self._queue.put_nowait(_Chunk(request, sealer, part))

    def close(self) -> None:
        self.closed = True

    async def write_to(self, ws: ClientConnection) -> None:
        """Send what is queued, turn by turn. The frames of a turn go to the protocol in batches of
        about WRITE_BYTES, each leaving in one write (``BatchedWrites``) — a request's last chunk and
        its `inference_complete` usually share one, and the coordinator wakes once for them — and the
        writer waits for the socket to drain after each, before it makes the next batch's frames."""
        while True:
            waiting = [await self._queue.get()]
            while not self._queue.empty():
                waiting.append(self._queue.get_nowait())
            frames = _frames(waiting, self.merge_chunks)
            while batch := _take(frames, WRITE_BYTES):
                async with ws.send_context():  # websockets' own way to queue frames, then write them
                    for data in batch:
                        ws.protocol.send_text(data)


class BatchedWrites(ClientConnection):
    """The node's connection to its coordinator: what the protocol has queued leaves in one system
    call (the transport's ``writelines``) instead of one write per frame."""

    def send_data(self) -> None:
        data = self.protocol.data_to_send()
        frames = [piece for piece in data if piece]
        if frames:
            self.transport.writelines(frames)
        if len(frames) < len(data):  # b"": the end of the stream, handled as websockets' own send_data does
            if not self.transport.can_write_eof():
                self.transport.close()  # TLS
                return
            with contextlib.suppress(Exception):  # uvloop may raise RuntimeError here
                self.transport.write_eof()


def _take(frames: Iterator[str], limit: int) -> list[bytes]:
    """The next frames, made now, until they hold ``limit`` bytes (at least one while any is left)."""
    batch: list[bytes] = []
    size = 0
    for text in frames:
        batch.append(text.encode())
        size += len(batch[-1])
        if size >= limit:
            break
    return batch


def _frames(waiting: list[tuple[_Request | None, str] | _Chunk], merge: bool) -> Iterator[str]:
    """The frames for what was waiting, in order, made as the writer takes them (``_take``: batch by
    batch, so a request cancelled while the writer waits for the socket sends nothing more): adjacent
    chunks of one request merged."""
    index = 0
    while index < len(waiting):
        item = waiting[index]
        index += 1
        if not isinstance(item, _Chunk):
            request, text = item
            if request is None or not request.cancelled:
                yield text
            continue
        if item.request.cancelled:
            continue
        parts, size = [item.data], len(item.data)
        while merge and index < len(waiting) and len(parts) < COALESCE_CHUNKS:
            after = waiting[index]
            if not (isinstance(after, _Chunk) and after.request is item.request
                    and size + len(after.data) <= COALESCE_BYTES):
                break
            parts.append(after.data)
            size += len(after.data)
            index += 1
        plaintext = parts[0] if len(parts) == 1 else b"[" + b",".join(parts) + b"]"
        yield protocol.dump(protocol.InferenceResponseChunk(
            request_id=item.request.request_id, encrypted_data=item.sealer.seal(plaintext)))


def _split(chunk: dict[str, Any]) -> list[bytes]:
    """A list chunk as several of the same shape, each with as many of its `data` items as fit in
    SPLIT_BYTES (at least one); any other chunk as it is."""
    data = chunk.get("data")
    if chunk.get("object") != "list" or not isinstance(data, list) or len(data) < 2:
        return [json_codec.dumps(chunk)]
    parts: list[list[Any]] = [[]]
    size = 0
    for item, item_size in ((item, len(json_codec.dumps(item)) + 1) for item in data):
        if parts[-1] and size + item_size > SPLIT_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += item_size
    return [json_codec.dumps(dict(chunk, data=part)) for part in parts]


def closed_outbox() -> Outbox:
    outbox = Outbox()
    outbox.close()
    return outbox
