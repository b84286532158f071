"""Shares (docs/sharing.md): give, list, revoke, and what each one used."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response

from darkbloom.coordinator.http.auth import require_account_writer, require_caller
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money.usage_history import row_view
from darkbloom.coordinator.identity.shares import share_fields, share_not_found, share_view
from darkbloom.coordinator.routing.selfroute import machine_not_found
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts, machines, shares

router = APIRouter()


@router.post("/v1/shares", status_code=201)
async def create_share(request: Request, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    """The same answer whether or not the email has an account: a share to an unknown email waits
    for the sign-up."""
    body = await json_object(request)
    async with services.engine.begin() as conn:
        owner = await accounts.get(conn, caller.account_id)
        assert owner is not None
        fields = share_fields(body, owner_email=owner["email"], now=time.time())
        if fields["machine_ids"] is not None:
            linked = {m["id"] for m in await machines.list_for(conn, caller.account_id)}
            if not set(fields["machine_ids"]) <= linked:
                raise machine_not_found()
        row = await shares.create(conn, caller.account_id, fields)
    return share_view(row)


@router.get("/v1/shares")
async def list_shares(caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        given = await shares.given(conn, caller.account_id)
        received = await shares.received(conn, caller.account_id)
        names = await shares.machine_names(conn, {r["owner_account_id"] for r in received})
    return {"given": [share_view(r) for r in given],
            "received": [share_view(r, machine_names=names.get(r["owner_account_id"], {})) for r in received]}


@router.delete("/v1/shares/{share_id}", status_code=204)
async def revoke_share(share_id: str, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> Response:
    """Owner or grantee; new requests on it are refused at once on every replica (routing reads the
    database), requests in flight finish at its terms."""
    async with services.engine.begin() as conn:
        if not await shares.revoke(conn, share_id, caller.account_id):
            raise share_not_found()
    return Response(status_code=204)


@router.get("/v1/shares/{share_id}/usage")
async def share_usage(share_id: str, limit: int = Query(100, ge=1, le=500), caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        row = await shares.visible_to(conn, share_id, caller.account_id)
        if row is None:
            raise share_not_found()
        today = await shares.usage_today(conn, share_id, shares.utc_day(time.time()))
        rows = await shares.usage_rows(conn, share_id, limit)
    return {"share_id": share_id, "today": today, "data": [row_view(r) for r in rows]}
