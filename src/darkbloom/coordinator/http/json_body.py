"""Reading small JSON bodies for the account, key, device and admin routes."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from darkbloom.coordinator.http.errors import NUL_MESSAGE
from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.openai.errors import invalid_request


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object (an empty body is ``{}``); NUL characters refused up front."""
    raw = await request.body()
    body = parse_json_object(raw) if raw.strip() else {}
    if _contains_nul(body):
        raise invalid_request(NUL_MESSAGE)
    return body


def _contains_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
