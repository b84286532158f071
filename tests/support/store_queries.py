"""Read-only store queries that only tests ask (production code never needs them)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.ledger import Pocket
from darkbloom.store.schema import key_spend, ledger_entries, machines


async def has_linked(conn: AsyncConnection, account_id: str) -> bool:
    """Whether the account has a machine linked now (unlinked ones excluded)."""
    row = (await conn.execute(select(machines.c.id).where(
        machines.c.account_id == account_id, machines.c.unlinked_at.is_(None)).limit(1))).first()
    return row is not None


async def key_window_spend(conn: AsyncConnection, key_id: str, window_start: int) -> tuple[int, int]:
    """(spent, reserved) µUSD of a key's spend window; (0, 0) before its first reservation."""
    row = (await conn.execute(select(key_spend.c.spent_micro_usd, key_spend.c.reserved_micro_usd).where(
        key_spend.c.key_id == key_id, key_spend.c.window_start == window_start))).first()
    return (int(row[0]), int(row[1])) if row else (0, 0)


async def ledger_sum(conn: AsyncConnection, account_id: str, pocket: Pocket) -> int:
    """The sum of an account's ledger entries for one pocket (what its balance must equal)."""
    total = (await conn.execute(select(func.coalesce(func.sum(ledger_entries.c.amount_micro_usd), 0)).where(
        ledger_entries.c.account_id == account_id, ledger_entries.c.pocket == pocket))).scalar()
    return int(total or 0)
