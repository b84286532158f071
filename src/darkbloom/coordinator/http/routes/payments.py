"""Balance, usage rows (a page, per day, as CSV) and provider earnings of the calling account."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from darkbloom.coordinator.http.auth import require_caller
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money import usage_history
from darkbloom.wire.openai.errors import invalid_request
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts, ledger

router = APIRouter()


@router.get("/v1/payments/balance")
async def balance(caller: Caller = Depends(require_caller),
                  services: Services = Depends(get_services)) -> dict[str, int]:
    async with services.engine.connect() as conn:
        row = await accounts.get(conn, caller.account_id)
    assert row is not None
    return {"balance_micro_usd": int(row["balance_micro_usd"]),
            "withdrawable_micro_usd": int(row["withdrawable_micro_usd"])}


def _cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    if not cursor.isdigit() or len(cursor) > 18:
        raise invalid_request("'cursor' must be the next_cursor value of a previous page.", param="cursor")
    return int(cursor)


def _page(rows: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], str | None]:
    page = rows[:limit]
    return page, (str(page[-1]["id"]) if len(rows) > limit else None)


@router.get("/v1/payments/usage")
async def usage(limit: int = Query(50, ge=1, le=500), cursor: str | None = None,
                caller: Caller = Depends(require_caller),
                services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        rows = await ledger.usage_page(conn, account_id=caller.account_id, limit=limit + 1,
                                       before_id=_cursor(cursor))
    page, next_cursor = _page(rows, limit)
    return {"object": "list", "next_cursor": next_cursor, "data": [usage_history.row_view(r) for r in page]}


@router.get("/v1/payments/usage.csv")
async def usage_csv(caller: Caller = Depends(require_caller),
                    services: Services = Depends(get_services)) -> StreamingResponse:
    return StreamingResponse(usage_history.csv_lines(services, caller.account_id), media_type="text/csv",
                             headers={"Content-Disposition": 'attachment; filename="darkbloom-usage.csv"'})


@router.get("/v1/payments/usage/daily")
async def usage_daily(days: int = Query(30), caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    return {"data": await usage_history.daily(services, caller.account_id, days)}


@router.get("/v1/provider/earnings")
async def earnings(limit: int = Query(50, ge=1, le=500), cursor: str | None = None,
                   caller: Caller = Depends(require_caller),
                   services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        rows = await ledger.usage_page(conn, provider_account_id=caller.account_id, limit=limit + 1,
                                       before_id=_cursor(cursor))
        total = await ledger.total_payouts(conn, caller.account_id)
    page, next_cursor = _page(rows, limit)
    return {"object": "list", "next_cursor": next_cursor, "total_micro_usd": total, "data": [{
        "request_id": r["request_id"], "created_at": r["created_at"], "model": r["model"],
        "provider_id": r["provider_id"], "prompt_tokens": r["prompt_tokens"],
        "completion_tokens": r["completion_tokens"], "payout_micro_usd": r["provider_payout_micro_usd"]}
        for r in page]}
