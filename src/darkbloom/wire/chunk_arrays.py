"""What an opened ``inference_response_chunk`` holds: one chunk object, or a non-empty array of
them that the node sent together, bounded before it is parsed and after.

A node merges at most 64 KiB of chunks into one array (provider/outbox.py), and none of its chunks
is under 16 bytes, so an array never holds more than MAX_CHUNKS_PER_FRAME. Parsing costs the event
loop about a microsecond per JSON object or array, so a plaintext with more than
MAX_CONTAINERS_PER_FRAME of them (counted as ``{`` and ``[`` bytes, strings' included: 64 KiB of
chunks cannot hold more) is refused unparsed; 800,000 ``{}`` would hold the loop for 0.3 s.
"""

from __future__ import annotations

from typing import Any

from darkbloom.wire import json_codec

MAX_CHUNKS_PER_FRAME = 4096
MAX_CONTAINERS_PER_FRAME = 16 * MAX_CHUNKS_PER_FRAME


def response_chunks(plaintext: bytes) -> list[dict[str, Any]]:
    """The OpenAI chunks a frame carries (ValueError when it carries anything else)."""
    containers = plaintext.count(b"{") + plaintext.count(b"[")
    if containers > MAX_CONTAINERS_PER_FRAME:
        raise ValueError(f"{containers} JSON objects and arrays, over the {MAX_CONTAINERS_PER_FRAME} one frame "
                         "may carry")
    data = json_codec.loads(plaintext)
    chunks = data if isinstance(data, list) else [data]
    if len(chunks) > MAX_CHUNKS_PER_FRAME:
        raise ValueError(f"an array of {len(chunks)} chunks, over the {MAX_CHUNKS_PER_FRAME} one frame may carry")
    if not chunks or not all(isinstance(chunk, dict) for chunk in chunks):
        raise ValueError("a response chunk must be a JSON object or a non-empty array of them")
    return chunks
