"""Shares (docs/sharing.md): give, change, answer, list, revoke, and what each one used."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.convertors import Convertor, register_url_convertor

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.coordinator.http.auth import require_account_writer, require_caller
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money.usage_history import row_view
from darkbloom.coordinator.identity.shares import (SHARE_INVITE, email_not_verified, share_changes, share_fields,
                                                   share_not_found, share_view, shown_terms)
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts, machines, shares
from darkbloom.wire.crypto import new_token, token_hash
from darkbloom.wire.openai.errors import ApiError

router = APIRouter()


class _ShareId(Convertor[str]):
    """A share id in a path: any segment but ``accept``, so that /v1/shares/accept (redeeming an
    invite code) is one resource whose only method is POST, not also share "accept"."""

    regex = r"(?!accept$)[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("share_id", _ShareId())


@router.post("/v1/shares", status_code=201)
async def create_share(request: Request, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    """The same answer whether or not the email has an account. The share waits, pending, for the
    person the owner means: whoever redeems its invite code (shown here only), or the account that
    proves it owns the address and accepts."""
    body = await json_object(request)
    invite_code = new_token("dki-")
    async with services.engine.begin() as conn:
        owner = await accounts.get(conn, caller.account_id)
        assert owner is not None
        fields = share_fields(body, owner_email=owner["email"], now=time.time())
        await _check_machines(conn, caller, fields)
        row = await shares.create(conn, caller.account_id, fields, token_hash(invite_code))
    return {**share_view(row), "invite_code": invite_code}


@router.patch("/v1/shares/{share_id:share_id}")
async def change_share(share_id: str, request: Request, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    """The owner's changes; new prices or machines put the share back to pending until its grantee
    accepts them."""
    body = await json_object(request)
    fields = share_changes(body, now=time.time())
    async with services.engine.begin() as conn:
        await _check_machines(conn, caller, fields)
        row = await shares.change(conn, share_id, caller.account_id, fields)
    if row is None:
        raise share_not_found()
    return share_view(row)


async def _check_machines(conn: Any, caller: Caller, fields: dict[str, Any]) -> None:
    if fields.get("machine_ids") is not None:
        linked = {m["id"] for m in await machines.list_for(conn, caller.account_id)}
        if not set(fields["machine_ids"]) <= linked:
            raise machine_not_found()


@router.post("/v1/shares/accept", status_code=201)
async def accept_invite(request: Request, caller: Caller = Depends(require_account_writer),
                        services: Services = Depends(get_services)) -> dict[str, Any]:
    """The invite code the owner handed over: the share becomes this account's, accepted."""
    code = SHARE_INVITE.validate(await json_object(request))["invite_code"]
    async with services.engine.begin() as conn:
        share_id = await shares.redeem(conn, token_hash(code.strip()), caller.account_id)
        if share_id is None:
            raise share_not_found()
        return await _received_view(conn, share_id)


@router.post("/v1/shares/{share_id:share_id}/accept")
async def accept_share(share_id: str, request: Request, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    return await _answer(share_id, "accepted", request, caller, services)


@router.post("/v1/shares/{share_id:share_id}/decline")
async def decline_share(share_id: str, request: Request, caller: Caller = Depends(require_account_writer),
                        services: Services = Depends(get_services)) -> dict[str, Any]:
    return await _answer(share_id, "declined", request, caller, services)


async def _answer(share_id: str, status: str, request: Request, caller: Caller,
                  services: Services) -> dict[str, Any]:
    """An account answers a share it was given, or one sent to its address once it has verified it.
    A body may repeat the prices and machines the grantee was shown: a share whose terms changed since
    is not answered (409 ``share_terms_changed``)."""
    shown = shown_terms(await json_object(request))
    async with services.engine.begin() as conn:
        row = await shares.addressed_to(conn, share_id, caller.account_id)
        if row is None:
            raise share_not_found()
        if row["grantee_account_id"] is None:
            account = await accounts.get(conn, caller.account_id)
            if account is None or account["email_verified_at"] is None:
                raise email_not_verified()
        if not await shares.answer(conn, share_id, caller.account_id, status, shown):
            if await shares.addressed_to(conn, share_id, caller.account_id) is None:
                raise share_not_found()
            raise ApiError(409, "share_terms_changed",
                           "The share's prices or machines changed since you saw them: read it again "
                           "(GET /v1/shares) and answer the terms it has now.")
        return await _received_view(conn, share_id)


async def _received_view(conn: Any, share_id: str) -> dict[str, Any]:
    row = await shares.get(conn, share_id)
    assert row is not None
    names = await shares.machine_names(conn, {row["owner_account_id"]})
    return share_view(row, machine_names=names.get(row["owner_account_id"], {}))


@router.get("/v1/shares")
async def list_shares(caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        given = await shares.given(conn, caller.account_id)
        received = await shares.received(conn, caller.account_id)
        names = await shares.machine_names(conn, {r["owner_account_id"] for r in received})
    return {"given": [share_view(r) for r in given],
            "received": [share_view(r, machine_names=names.get(r["owner_account_id"], {})) for r in received]}


@router.delete("/v1/shares/{share_id:share_id}", status_code=204)
async def revoke_share(share_id: str, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> Response:
    """Owner or grantee; new requests on it are refused at once on every replica (routing reads the
    database), requests in flight finish at its terms."""
    async with services.engine.begin() as conn:
        if not await shares.revoke(conn, share_id, caller.account_id):
            raise share_not_found()
    return Response(status_code=204)


@router.get("/v1/shares/{share_id:share_id}/usage")
async def share_usage(share_id: str, limit: int = Query(100, ge=1, le=500), caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        row = await shares.visible_to(conn, share_id, caller.account_id)
        if row is None:
            raise share_not_found()
        today = await shares.usage_today(conn, share_id, shares.utc_day(time.time()))
        rows = await shares.usage_rows(conn, share_id, limit)
    return {"share_id": share_id, "today": today, "data": [row_view(r) for r in rows]}
