"""Accounts and admin credits."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.wire.crypto import new_id
from darkbloom.store import ledger
from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import accounts, admin_credits


class EmailTaken(Exception):
    pass


class BalanceCapExceeded(Exception):
    """A credit would take the balance past its cap; the caller's transaction must roll back."""


async def create_account(conn: AsyncConnection, email: str | None, password_hash: str | None,
                         balance: int = 0) -> str:
    account_id = new_id("acct_")
    inserted = await insert_ignore(conn, accounts, id=account_id, email=email, password_hash=password_hash,
                                   balance_micro_usd=balance, withdrawable_micro_usd=0,
                                   created_at=int(time.time()))
    if not inserted:
        raise EmailTaken(email)
    return account_id


async def get_by_email(conn: AsyncConnection, email: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(accounts).where(accounts.c.email == email))).mappings().first()
    return dict(row) if row else None


async def get(conn: AsyncConnection, account_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(accounts).where(accounts.c.id == account_id))).mappings().first()
    return dict(row) if row else None


async def credit(conn: AsyncConnection, account_id: str, amount: int, reference: str, *,
                 max_balance: int | None = None) -> int | None:
    """Add ``amount`` µUSD once per ``reference``; returns the new balance, or None if no account.

    A reference seen before changes nothing and returns the current balance. A credit that would take
    the balance past ``max_balance`` raises BalanceCapExceeded (one conditional UPDATE decides)."""
    if await get(conn, account_id) is None:
        return None
    if await insert_ignore(conn, admin_credits, reference=reference, account_id=account_id,
                           amount_micro_usd=amount, created_at=int(time.time())):
        moved = await ledger.move(conn, account_id, "balance", amount, "admin_credit", reference=reference,
                                  at_most=max_balance)
        if moved is None:
            raise BalanceCapExceeded(account_id)
    row = await get(conn, account_id)
    return int(row["balance_micro_usd"]) if row else None
