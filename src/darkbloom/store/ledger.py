"""Money movement primitives. Every change to a pocket writes a ledger entry with the pocket's new
value, so any balance can be recomputed from its entries. Callers group these in one transaction."""

from __future__ import annotations

import time
from typing import Any, Literal

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import accounts, key_spend, ledger_entries, reservations, usage_records

Pocket = Literal["balance", "withdrawable"]


async def move(conn: AsyncConnection, account_id: str, pocket: Pocket, amount: int, kind: str, *,
               request_id: str | None = None, reference: str | None = None,
               require_funds: bool = False) -> int | None:
    """Add ``amount`` (may be negative) to a pocket; None when the account is missing or, with
    ``require_funds``, when the pocket would go below zero (checked in the same UPDATE)."""
    column = accounts.c.balance_micro_usd if pocket == "balance" else accounts.c.withdrawable_micro_usd
    statement = update(accounts).where(accounts.c.id == account_id)
    if require_funds:
        statement = statement.where(column >= -amount)
    row = (await conn.execute(statement.values({column: column + amount}).returning(column))).first()
    if row is None:
        return None
    await conn.execute(insert(ledger_entries).values(
        account_id=account_id, kind=kind, pocket=pocket, amount_micro_usd=amount, balance_after=row[0],
        request_id=request_id, reference=reference, created_at=int(time.time())))
    return int(row[0])


async def lock_accounts(conn: AsyncConnection, account_ids: set[str]) -> None:
    """Lock these account rows in id order before moving money between them (a no-op on SQLite, whose
    writers are serialised anyway). Every transaction that touches several pockets takes its locks in
    one global order — reservation row, then the key's spend window, then accounts by id — so two
    settlements (A pays B while B pays A, both paying the platform) cannot deadlock on Postgres."""
    await conn.execute(select(accounts.c.id).where(accounts.c.id.in_(sorted(account_ids)))
                       .order_by(accounts.c.id).with_for_update())


async def open_reservation(conn: AsyncConnection, request_id: str, account_id: str, key_id: str | None,
                           amount: int, window_start: int | None, instance_id: str) -> None:
    await conn.execute(insert(reservations).values(
        request_id=request_id, account_id=account_id, key_id=key_id, amount_micro_usd=amount,
        window_start=window_start, status="open", instance_id=instance_id, created_at=int(time.time())))


async def close_reservation(conn: AsyncConnection, request_id: str, status: str) -> dict[str, Any] | None:
    """open → settled|refunded exactly once; returns the reservation, or None if already closed."""
    row = (await conn.execute(
        update(reservations)
        .where(reservations.c.request_id == request_id, reservations.c.status == "open")
        .values(status=status, closed_at=int(time.time()))
        .returning(*reservations.c)
    )).mappings().first()
    return dict(row) if row else None


async def open_reservations(conn: AsyncConnection, instance_ids: list[str] | None = None) -> list[dict[str, Any]]:
    query = select(reservations).where(reservations.c.status == "open")
    if instance_ids is not None:
        query = query.where(reservations.c.instance_id.in_(instance_ids))
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def reserve_key_spend(conn: AsyncConnection, key_id: str, window_start: int, cap: int, amount: int) -> bool:
    """Hold ``amount`` against a key's cap: spent + reserved + amount ≤ cap, in one conditional UPDATE."""
    await insert_ignore(conn, key_spend, key_id=key_id, window_start=window_start, spent_micro_usd=0,
                        reserved_micro_usd=0)
    result = await conn.execute(
        update(key_spend)
        .where(key_spend.c.key_id == key_id, key_spend.c.window_start == window_start,
               key_spend.c.spent_micro_usd + key_spend.c.reserved_micro_usd + amount <= cap)
        .values(reserved_micro_usd=key_spend.c.reserved_micro_usd + amount))
    return result.rowcount > 0


async def release_key_spend(conn: AsyncConnection, key_id: str, window_start: int, reserved: int,
                            spent: int) -> None:
    await conn.execute(
        update(key_spend)
        .where(key_spend.c.key_id == key_id, key_spend.c.window_start == window_start)
        .values(reserved_micro_usd=key_spend.c.reserved_micro_usd - reserved,
                spent_micro_usd=key_spend.c.spent_micro_usd + spent))


async def record_usage(conn: AsyncConnection, **values: Any) -> bool:
    """One usage row per request id; a second attempt is a no-op."""
    return await insert_ignore(conn, usage_records, created_at=int(time.time()), **values)


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
