"""Reading an OpenAI request body: a size limit from configuration (413 `request_too_large`) and one
JSON object (400 `invalid_request_error`). Used by direct mode; the coordinator's edge can use it too."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from darkbloom.wire.openai.errors import ApiError, invalid_request

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # CONTRACT: bodies over 8 MiB get 413


def size_text(size: int) -> str:
    """`8 MiB`, `512 KiB` or `1000 bytes`: a byte count as a person would write it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def too_large_message(max_bytes: int) -> str:
    return f"The request body is larger than {size_text(max_bytes)}."


def request_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "request_too_large", too_large_message(max_bytes))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused (413) as soon as its declared or received length passes `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise request_too_large(max_bytes)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise request_too_large(max_bytes)
    return bytes(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    return parse_json_object(await read_body(request, max_bytes))
