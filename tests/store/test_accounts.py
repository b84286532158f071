"""Accounts, console sessions and idempotent admin credits, on SQLite and Postgres."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.wire.crypto import token_hash
from darkbloom.store import accounts, console_sessions, schema


async def test_create_account_and_read_it_back(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "ada@example.com", "hash", balance=1234)
    assert account_id.startswith("acct_")
    async with engine.connect() as conn:
        by_id = await accounts.get(conn, account_id)
        by_email = await accounts.get_by_email(conn, "ada@example.com")
        missing = await accounts.get_by_email(conn, "nobody@example.com")
    assert by_id is not None and by_id == by_email
    assert by_id["balance_micro_usd"] == 1234
    assert by_id["withdrawable_micro_usd"] == 0
    assert by_id["password_hash"] == "hash"
    assert missing is None


async def test_email_is_unique(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        first = await accounts.create_account(conn, "dup@example.com", "h1")
    with pytest.raises(accounts.EmailTaken):
        async with engine.begin() as conn:
            await accounts.create_account(conn, "dup@example.com", "h2")
    async with engine.connect() as conn:
        row = await accounts.get_by_email(conn, "dup@example.com")
    assert row is not None and row["id"] == first and row["password_hash"] == "h1"


async def test_accounts_without_email_do_not_collide(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        a = await accounts.create_account(conn, None, None)
        b = await accounts.create_account(conn, None, None)
    assert a != b


async def test_console_session_lookup_and_delete(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "s@example.com", "h")
        await console_sessions.create(conn, account_id, token_hash("dks-one"))
    async with engine.connect() as conn:
        assert await console_sessions.account_for(conn, token_hash("dks-one")) == account_id
        assert await console_sessions.account_for(conn, token_hash("dks-other")) is None
    async with engine.begin() as conn:
        await console_sessions.delete(conn, token_hash("dks-one"))
    async with engine.connect() as conn:
        assert await console_sessions.account_for(conn, token_hash("dks-one")) is None


async def test_expired_console_session_finds_no_account(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "e@example.com", "h")
        await console_sessions.create(conn, account_id, token_hash("dks-live"))
        await console_sessions.create(conn, account_id, token_hash("dks-old"))
        await conn.execute(update(schema.console_sessions)
                           .where(schema.console_sessions.c.token_hash == token_hash("dks-old"))
                           .values(expires_at=int(time.time()) - 1))
    async with engine.connect() as conn:
        assert await console_sessions.account_for(conn, token_hash("dks-old")) is None
        assert await console_sessions.account_for(conn, token_hash("dks-live")) == account_id


async def test_new_console_session_lives_for_the_ttl(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "ttl@example.com", "h")
        await console_sessions.create(conn, account_id, token_hash("dks-ttl"))
        row = (await conn.execute(schema.console_sessions.select())).mappings().one()
    assert row["expires_at"] - row["created_at"] == console_sessions.TTL_SECONDS


async def test_credit_is_idempotent_on_reference(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "c@example.com", "h", balance=10)
    async with engine.begin() as conn:
        assert await accounts.credit(conn, account_id, 500, "grant-1") == 510
    async with engine.begin() as conn:
        # the same reference again, even with another amount, changes nothing
        assert await accounts.credit(conn, account_id, 999, "grant-1") == 510
    async with engine.begin() as conn:
        assert await accounts.credit(conn, account_id, 40, "grant-2") == 550
    async with engine.connect() as conn:
        row = await accounts.get(conn, account_id)
    assert row is not None and row["balance_micro_usd"] == 550


async def test_credit_to_a_missing_account_returns_none(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await accounts.credit(conn, "acct_missing", 5, "ref") is None


async def test_credit_reference_is_global_across_accounts(engine: AsyncEngine) -> None:
    """A reference names one credit: reusing it for another account does not credit that account."""
    async with engine.begin() as conn:
        a = await accounts.create_account(conn, "a@example.com", "h")
        b = await accounts.create_account(conn, "b@example.com", "h")
        assert await accounts.credit(conn, a, 100, "shared-ref") == 100
        assert await accounts.credit(conn, b, 100, "shared-ref") == 0


async def test_concurrent_credits_never_pass_the_cap(engine: AsyncEngine) -> None:
    """Sixteen credits at once, room for five: one conditional UPDATE each decides, and a refused
    credit leaves no admin-credit row and no ledger entry behind."""
    cap, amount = 1_000_000, 1_000
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "cap@example.com", "h", balance=cap - 5 * amount)

    async def credit(i: int) -> int | None:
        try:
            async with engine.begin() as conn:
                return await accounts.credit(conn, account_id, amount, f"near-cap-{i}", max_balance=cap)
        except accounts.BalanceCapExceeded:
            return None

    results = await asyncio.gather(*(credit(i) for i in range(16)))
    assert sorted(r for r in results if r is not None) == [cap - 4 * amount + i * amount for i in range(5)]
    async with engine.connect() as conn:
        row = await accounts.get(conn, account_id)
        credits = (await conn.execute(select(func.count()).select_from(schema.admin_credits)
                                      .where(schema.admin_credits.c.account_id == account_id))).scalar()
        entries = (await conn.execute(select(func.count()).select_from(schema.ledger_entries)
                                      .where(schema.ledger_entries.c.account_id == account_id))).scalar()
    assert row is not None and row["balance_micro_usd"] == cap
    assert credits == entries == 5


async def test_a_credit_exactly_to_the_cap_is_taken(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "edge@example.com", "h", balance=90)
        assert await accounts.credit(conn, account_id, 10, "to-the-cap", max_balance=100) == 100
    with pytest.raises(accounts.BalanceCapExceeded):
        async with engine.begin() as conn:
            await accounts.credit(conn, account_id, 1, "past-the-cap", max_balance=100)
