"""What an OpenAI-compatible upstream sends back, read for the `openai` backend: its SSE event stream
(lines of any length, read past `[DONE]` so its connection can be pooled again) and its errors, in
our own words — an upstream's error text can quote the prompt and `inference_error` leaves the node
unsealed, so only its status and its error `type`/`code` identifiers are kept, inside a sentence of
ours; its `param` (when it is an identifier) and a `code` we pass on (`PROVIDER_ERROR_CODES`) go with
it."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, AsyncIterator

import aiohttp

from darkbloom.provider.backends.base import BackendError
from darkbloom.wire import json_codec
from darkbloom.wire.protocol import PROVIDER_ERROR_CODES

END_OF_BODY_BYTES = 4096  # what may follow [DONE] before the connection is dropped instead
END_OF_BODY_WAIT = 1.0
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one SSE line longer than this is not an answer we relay


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    lines = _lines(response.content)
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            await _read_to_the_end(response.content)
            return
        try:
            chunk = json_codec.loads(data)
        except ValueError:
            raise BackendError(502, "upstream sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise BackendError(502, "upstream sent an event that is not a JSON object")
        if "error" in chunk:
            kinds = _error_kinds(chunk)
            raise BackendError(502, f"the upstream failed mid-stream ({kinds})" if kinds else
                               "the upstream failed mid-stream")
        yield chunk
    # Without [DONE] the upstream failed after sending its headers (some servers report a
    # too-long prompt this way); a truncated answer must not pass for a complete one.
    raise BackendError(502, "upstream closed the stream before it was complete")


async def _lines(body: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines as they arrive (ended by ``\n``, ``\r\n`` or ``\r``, as SSE allows), whatever
    their length up to MAX_EVENT_BYTES (aiohttp's own line reader stops at 128 KiB). A ``\r\n`` split
    across two reads makes one extra empty line, which SSE ignores."""
    line = bytearray()
    async for data in body.iter_any():
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line += data[start:end]
            yield bytes(line)
            line.clear()
            start = end + 1
        line += data[start:]
        if len(line) > MAX_EVENT_BYTES:
            raise BackendError(502, "upstream sent an event line that is too long")
    if line:
        yield bytes(line)


async def _read_to_the_end(body: aiohttp.StreamReader) -> None:
    """Read the (empty) rest of the body after [DONE]: a response read to its end gives its connection
    back to the pool, one closed early takes it down. An upstream that keeps sending loses the
    connection instead of delaying the answer."""
    left = END_OF_BODY_BYTES
    try:
        async with asyncio.timeout(END_OF_BODY_WAIT):
            while left > 0 and (data := await body.readany()):
                left -= len(data)
    except (TimeoutError, aiohttp.ClientError):
        pass  # the answer is whole; this connection just does not go back to the pool


def upstream_error(status: int, raw: bytes) -> BackendError:
    """The upstream's status and error identifiers in our own words; its message is never passed on.
    A redirect is not followed (it could carry the prompt to another host): the node's fault, 502."""
    if status < 400:
        return BackendError(502, f"the upstream answered with a redirect ({status}); set upstream_url to the "
                                 "API's own address")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    verb = "rejected the request" if status < 500 else "failed to serve the request"
    kinds = _error_kinds(data)
    error = data.get("error") if isinstance(data, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    message = f"the upstream {verb} ({status} {kinds})" if kinds else f"the upstream {verb} ({status})"
    return BackendError(status, message,
                        param=param if isinstance(param, str) and _PARAM.fullmatch(param) else None,
                        code=code if code in PROVIDER_ERROR_CODES else None)


_IDENTIFIER = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_PARAM = re.compile(r"[A-Za-z0-9_.\[\]-]{1,128}")


def _error_kinds(data: Any) -> str:
    """`error.type` and `error.code` of an OpenAI-style error object as "type, code", each only when it
    is an identifier (free text there is dropped like the message); "" when there are none."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return ""
    kinds: list[str] = []
    for key in ("type", "code"):
        value = error.get(key)
        value = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
        if _IDENTIFIER.fullmatch(value) and value not in kinds:
            kinds.append(value)
    return ", ".join(kinds)
