"""Admin API (admin token): credits, the model catalog and machine enrollment."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field, with_config
from typing_extensions import NotRequired, TypedDict

from darkbloom.wire.catalog import Catalog
from darkbloom.coordinator.http.auth import require_admin
from darkbloom.coordinator.routing.live_catalog import store_catalog
from darkbloom.wire.openai.body_schema import OPEN, BodySchema
from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.fleet.machines import enroll_machine
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts

router = APIRouter(prefix="/v1/admin", dependencies=[Depends(require_admin)])
MAX_CREDIT = 10**15        # µUSD in one credit: a billion dollars
MAX_BALANCE = 2**62        # far below the 64-bit columns' limit, so no sum of pockets can overflow


@with_config(OPEN)
class CreditRequest(TypedDict):
    """Name the account by account_id or email."""

    account_id: NotRequired[str | None]
    email: NotRequired[str | None]
    amount_micro_usd: Annotated[int, Field(ge=1, le=MAX_CREDIT)]
    reference: Annotated[str, Field(pattern=r"\S", max_length=200, description="Makes the credit idempotent.")]


CREDIT_REQUEST = BodySchema(CreditRequest, {
    "amount_micro_usd": f"'amount_micro_usd' must be a positive integer (µUSD), at most {MAX_CREDIT}.",
    "reference": "'reference' must be a non-empty string (it makes the credit idempotent).",
})
CATALOG = BodySchema(Catalog)


@router.post("/credit")
async def credit(request: Request, services: Services = Depends(get_services)) -> dict[str, Any]:
    body = CREDIT_REQUEST.validate(await json_object(request))
    amount, reference = body["amount_micro_usd"], body["reference"].strip()
    try:
        async with services.engine.begin() as conn:
            account_id = body.get("account_id")
            email = body.get("email")
            if not account_id and email is not None:
                row = await accounts.get_by_email(conn, email.strip().lower())
                account_id = row["id"] if row else None
            if not account_id:
                raise ApiError(404, "account_not_found", "No account with this id or email.")
            balance = await accounts.credit(conn, account_id, amount, reference, max_balance=MAX_BALANCE)
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
    catalog = CATALOG.validate(await json_object(request))
    await store_catalog(services, catalog)
    return catalog.model_dump()


@router.post("/machines/{machine_id}/enroll")
async def enroll(machine_id: str, services: Services = Depends(get_services)) -> dict[str, Any]:
    """Grant ``hardware`` trust: certify the machine's identity key with the enrollment CA."""
    return await enroll_machine(services, machine_id)
