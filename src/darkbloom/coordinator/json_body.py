"""Reading small JSON bodies for the account, key, device and admin routes."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from darkbloom.coordinator.errors import invalid_request


async def json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body
