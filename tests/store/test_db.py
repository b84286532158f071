"""``insert_ignore``: INSERT … ON CONFLICT DO NOTHING on both backends."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import accounts, admin_credits


async def test_insert_ignore_inserts_once_per_primary_key(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        first = await insert_ignore(conn, accounts, id="acct_1", email=None, password_hash=None,
                                    balance_micro_usd=5, withdrawable_micro_usd=0, created_at=1)
        second = await insert_ignore(conn, accounts, id="acct_1", email=None, password_hash=None,
                                     balance_micro_usd=99, withdrawable_micro_usd=0, created_at=2)
    assert (first, second) == (True, False)
    async with engine.connect() as conn:
        row = (await conn.execute(select(accounts).where(accounts.c.id == "acct_1"))).mappings().one()
    assert row["balance_micro_usd"] == 5  # the conflicting insert changed nothing


async def test_insert_ignore_also_skips_a_unique_column_conflict(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await insert_ignore(conn, accounts, id="acct_a", email="same@example.com", password_hash=None,
                                   balance_micro_usd=0, withdrawable_micro_usd=0, created_at=1)
        assert not await insert_ignore(conn, accounts, id="acct_b", email="same@example.com", password_hash=None,
                                       balance_micro_usd=0, withdrawable_micro_usd=0, created_at=1)
        count = (await conn.execute(select(func.count()).select_from(accounts)
                                    .where(accounts.c.email == "same@example.com"))).scalar_one()
    assert count == 1


async def test_insert_ignore_keeps_the_transaction_usable(engine: AsyncEngine) -> None:
    """A skipped insert is not an error: later statements in the same transaction still commit."""
    async with engine.begin() as conn:
        await insert_ignore(conn, accounts, id="acct_1", email=None, password_hash=None,
                            balance_micro_usd=0, withdrawable_micro_usd=0, created_at=1)
        await insert_ignore(conn, admin_credits, reference="ref", account_id="acct_1",
                            amount_micro_usd=1, created_at=1)
        assert not await insert_ignore(conn, admin_credits, reference="ref", account_id="acct_1",
                                       amount_micro_usd=2, created_at=1)
        assert await insert_ignore(conn, admin_credits, reference="ref-2", account_id="acct_1",
                                   amount_micro_usd=3, created_at=1)
    async with engine.connect() as conn:
        amounts = (await conn.execute(
            select(admin_credits.c.amount_micro_usd).order_by(admin_credits.c.reference))).scalars().all()
    assert amounts == [1, 3]
