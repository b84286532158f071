"""The ledger's SQLAlchemy side: ``move`` (admin credits: one pocket, one entry with the pocket's new
value, so any balance can be recomputed from its entries) and the reads (open reservations, usage
pages, payout totals). A request's reservation, settlement, refund and usage row are written by
the coordinator's ledger writer (``coordinator/money/ledger/writer.py``), in batches."""

from __future__ import annotations

import time
from typing import Any, Literal

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.schema import accounts, ledger_entries, reservations, usage_records

Pocket = Literal["balance", "withdrawable"]


async def move(conn: AsyncConnection, account_id: str, pocket: Pocket, amount: int, kind: str, *,
               request_id: str | None = None, reference: str | None = None,
               require_funds: bool = False, at_most: int | None = None) -> int | None:
    """Add ``amount`` (may be negative) to a pocket; None when the account is missing, with
    ``require_funds`` when the pocket would go below zero, or when it would pass ``at_most`` (both
    checked in the same UPDATE, so concurrent moves cannot pass them together)."""
    column = accounts.c.balance_micro_usd if pocket == "balance" else accounts.c.withdrawable_micro_usd
    statement = update(accounts).where(accounts.c.id == account_id)
    if require_funds:
        statement = statement.where(column >= -amount)
    if at_most is not None:
        statement = statement.where(column <= at_most - amount)
    row = (await conn.execute(statement.values({column: column + amount}).returning(column))).first()
    if row is None:
        return None
    await conn.execute(insert(ledger_entries).values(
        account_id=account_id, kind=kind, pocket=pocket, amount_micro_usd=amount, balance_after=row[0],
        request_id=request_id, reference=reference, created_at=int(time.time())))
    return int(row[0])


async def open_reservations(conn: AsyncConnection, instance_ids: list[str] | None = None) -> list[dict[str, Any]]:
    query = select(reservations).where(reservations.c.status == "open")
    if instance_ids is not None:
        query = query.where(reservations.c.instance_id.in_(instance_ids))
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def charged_for(conn: AsyncConnection, request_id: str) -> int | None:
    """What a request's usage row charged its caller (None: it has no usage row)."""
    return await conn.scalar(select(usage_records.c.cost_micro_usd).where(usage_records.c.request_id == request_id))


async def usage_page(conn: AsyncConnection, *, account_id: str | None = None,
                     provider_account_id: str | None = None, limit: int,
                     before_id: int | None) -> list[dict[str, Any]]:
    query = select(usage_records).order_by(usage_records.c.id.desc()).limit(limit)
    if account_id is not None:
        query = query.where(usage_records.c.account_id == account_id)
    if provider_account_id is not None:
        query = query.where(usage_records.c.provider_account_id == provider_account_id,
                            usage_records.c.provider_payout_micro_usd > 0)
    if before_id is not None:
        query = query.where(usage_records.c.id < before_id)
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def total_payouts(conn: AsyncConnection, provider_account_id: str) -> int:
    total = (await conn.execute(select(func.coalesce(func.sum(usage_records.c.provider_payout_micro_usd), 0))
                                .where(usage_records.c.provider_account_id == provider_account_id))).scalar()
    return int(total or 0)
