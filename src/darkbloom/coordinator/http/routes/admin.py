"""Admin API (admin token): credits, the model catalog and machine enrollment."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from darkbloom.wire.catalog import Catalog
from darkbloom.coordinator.http.auth import require_admin
from darkbloom.coordinator.routing.live_catalog import store_catalog
from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.fleet.machines import enroll_machine
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts

router = APIRouter(prefix="/v1/admin", dependencies=[Depends(require_admin)])
MAX_CREDIT = 10**15        # µUSD in one credit: a billion dollars
MAX_BALANCE = 2**62        # far below the 64-bit columns' limit, so no sum of pockets can overflow


@router.post("/credit")
async def credit(request: Request, services: Services = Depends(get_services)) -> dict[str, Any]:
    body = await json_object(request)
    amount, reference = body.get("amount_micro_usd"), body.get("reference")
    if not isinstance(amount, int) or isinstance(amount, bool) or not 0 < amount <= MAX_CREDIT:
        raise invalid_request(f"'amount_micro_usd' must be a positive integer (µUSD), at most {MAX_CREDIT}.",
                              param="amount_micro_usd")
    if not isinstance(reference, str) or not reference.strip() or len(reference) > 200:
        raise invalid_request("'reference' must be a non-empty string (it makes the credit idempotent).",
                              param="reference")
    try:
        async with services.engine.begin() as conn:
            account_id = body.get("account_id")
            if not account_id and isinstance(body.get("email"), str):
                row = await accounts.get_by_email(conn, body["email"].strip().lower())
                account_id = row["id"] if row else None
            if not isinstance(account_id, str):
                raise ApiError(404, "account_not_found", "No account with this id or email.")
            balance = await accounts.credit(conn, account_id, amount, reference.strip(), max_balance=MAX_BALANCE)
    except accounts.BalanceCapExceeded:
        raise invalid_request(f"This credit would take the balance past {MAX_BALANCE} µUSD.",
                              param="amount_micro_usd") from None
    if balance is None:
        raise ApiError(404, "account_not_found", "No account with this id or email.")
    return {"account_id": account_id, "balance_micro_usd": balance}


@router.get("/catalog")
async def get_catalog(services: Services = Depends(get_services)) -> dict[str, Any]:
    return services.settings.catalog.model_dump()


@router.put("/catalog")
async def put_catalog(request: Request, services: Services = Depends(get_services)) -> dict[str, Any]:
    try:
        catalog = Catalog.model_validate(await json_object(request))
    except ValidationError as exc:
        raise invalid_request(f"invalid catalog: {exc.errors()[0]['msg']}") from None
    await store_catalog(services, catalog)
    return catalog.model_dump()


@router.post("/machines/{machine_id}/enroll")
async def enroll(machine_id: str, services: Services = Depends(get_services)) -> dict[str, Any]:
    """Grant ``hardware`` trust: certify the machine's identity key with the enrollment CA."""
    return await enroll_machine(services, machine_id)
