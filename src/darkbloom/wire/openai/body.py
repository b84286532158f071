"""Reading an OpenAI request body: a size limit from configuration (413 `request_too_large`) and one
JSON object (400 `invalid_request_error`). Used by direct mode; the coordinator's edge can use it too."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from darkbloom.wire.openai.errors import ApiError, invalid_request

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # bodies over 8 MiB get 413 (docs/api.md "Bodies")


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


MAX_JSON_DEPTH = 100  # deeper than any real request; far below what recursion elsewhere could hold
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJson(name)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """One JSON object that every later layer can hold: standard JSON only (no NaN/Infinity), text
    that is valid Unicode (no lone surrogates such as "\\ud800"), nesting at most MAX_JSON_DEPTH."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except _NotJson as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc} is not a JSON number.") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    check_json_value(body)
    return body


def check_json_value(value: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string (or key) with a lone surrogate."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise invalid_request("Text in the request must be valid Unicode: it contains a lone surrogate "
                                      "(an unpaired \\ud800-\\udfff escape).")
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise invalid_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    return parse_json_object(await read_body(request, max_bytes))
