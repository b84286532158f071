"""Reading small JSON bodies for the account, key, device and admin routes."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from darkbloom.coordinator.errors import NUL_MESSAGE, invalid_request


async def json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
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
