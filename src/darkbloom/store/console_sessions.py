"""Console sessions (``dks-`` tokens, stored as SHA-256 hashes) of accounts that logged in."""

from __future__ import annotations

import time

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.schema import console_sessions

TTL_SECONDS = 30 * 24 * 3600


async def create(conn: AsyncConnection, account_id: str, token_hash: str) -> None:
    now = int(time.time())
    await conn.execute(insert(console_sessions).values(
        token_hash=token_hash, account_id=account_id, created_at=now, expires_at=now + TTL_SECONDS))


async def account_for(conn: AsyncConnection, token_hash: str) -> str | None:
    """The account of an unexpired session, else None."""
    row = (await conn.execute(
        select(console_sessions.c.account_id)
        .where(console_sessions.c.token_hash == token_hash, console_sessions.c.expires_at > int(time.time()))
    )).first()
    return row[0] if row else None


async def session_for(conn: AsyncConnection, token_hash: str) -> tuple[str, int] | None:
    """(account_id, expires_at) of an unexpired session, else None."""
    row = (await conn.execute(
        select(console_sessions.c.account_id, console_sessions.c.expires_at)
        .where(console_sessions.c.token_hash == token_hash, console_sessions.c.expires_at > int(time.time()))
    )).first()
    return (row[0], int(row[1])) if row else None


async def delete(conn: AsyncConnection, token_hash: str) -> None:
    await conn.execute(console_sessions.delete().where(console_sessions.c.token_hash == token_hash))
