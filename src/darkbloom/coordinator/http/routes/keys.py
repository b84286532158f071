"""API key management: create (secret shown once), list, read, edit, rotate, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from darkbloom.coordinator.identity.api_keys import key_fields, key_view
from darkbloom.coordinator.identity.auth_cache import key_subject
from darkbloom.coordinator.identity.auth_invalidation import changing
from darkbloom.coordinator.http.auth import require_account_writer, require_caller
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.services import Services, get_services
from darkbloom.wire.crypto import new_token, token_hash
from darkbloom.store import keys

router = APIRouter()


def _missing(key_id: str) -> ApiError:
    return ApiError(404, "key_not_found", f"No API key '{key_id}' on your account.")


@router.post("/v1/keys", status_code=201)
async def create_key(request: Request, caller: Caller = Depends(require_account_writer),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    fields = key_fields(await json_object(request), creating=True)
    secret = new_token("dk-")
    async with services.engine.begin() as conn:
        row = await keys.create(conn, caller.account_id, token_hash(secret), secret[:10], fields)
    return {**key_view(row), "key": secret}


@router.get("/v1/keys")
async def list_keys(limit: int = Query(100, ge=1, le=1000), cursor: str | None = None,
                    caller: Caller = Depends(require_caller),
                    services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        rows = await keys.list_for(conn, caller.account_id, limit + 1, cursor)
    page = rows[:limit]
    return {"object": "list", "data": [key_view(r) for r in page],
            "next_cursor": page[-1]["id"] if len(rows) > limit else None}


@router.get("/v1/keys/{key_id}")
async def get_key(key_id: str, caller: Caller = Depends(require_caller),
                  services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        row = await keys.get(conn, caller.account_id, key_id)
    if row is None:
        raise _missing(key_id)
    return key_view(row)


@router.patch("/v1/keys/{key_id}")
async def update_key(key_id: str, request: Request, caller: Caller = Depends(require_account_writer),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    fields = key_fields(await json_object(request), creating=False)
    async with changing(services, key_subject(key_id)) as conn:  # cached grants carry the old row
        row = await keys.update_fields(conn, caller.account_id, key_id, fields)
    if row is None:
        raise _missing(key_id)
    return key_view(row)


@router.post("/v1/keys/{key_id}/rotate")
async def rotate_key(key_id: str, caller: Caller = Depends(require_account_writer),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    secret = new_token("dk-")
    async with changing(services, key_subject(key_id)) as conn:  # the old secret is refused on every replica
        if not await keys.rotate(conn, caller.account_id, key_id, token_hash(secret), secret[:10]):
            raise _missing(key_id)
    return {"id": key_id, "object": "api_key", "key": secret}


@router.delete("/v1/keys/{key_id}")
async def delete_key(key_id: str, caller: Caller = Depends(require_account_writer),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    async with changing(services, key_subject(key_id)) as conn:
        if not await keys.revoke(conn, caller.account_id, key_id):
            raise _missing(key_id)
    return {"id": key_id, "object": "api_key", "deleted": True}
