"""Device login codes (RFC 8628 shape) and the provider device tokens they mint."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.schema import device_codes, device_tokens, machines


async def create_code(conn: AsyncConnection, device_code_hash: str, user_code: str, ttl: int) -> None:
    now = int(time.time())
    await conn.execute(insert(device_codes).values(
        device_code_hash=device_code_hash, user_code=user_code, status="pending",
        account_id=None, created_at=now, expires_at=now + ttl))


async def by_user_code(conn: AsyncConnection, user_code: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(device_codes).where(device_codes.c.user_code == user_code))).mappings().first()
    return dict(row) if row else None


async def by_device_code(conn: AsyncConnection, device_code_hash: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(device_codes).where(
        device_codes.c.device_code_hash == device_code_hash))).mappings().first()
    return dict(row) if row else None


async def approve(conn: AsyncConnection, user_code: str, account_id: str) -> bool:
    """pending → approved, exactly once."""
    result = await conn.execute(update(device_codes).where(
        device_codes.c.user_code == user_code, device_codes.c.status == "pending"
    ).values(status="approved", account_id=account_id))
    return result.rowcount > 0


async def mark_issued(conn: AsyncConnection, device_code_hash: str) -> bool:
    """approved → issued, exactly once (so the token is handed out once)."""
    result = await conn.execute(update(device_codes).where(
        device_codes.c.device_code_hash == device_code_hash, device_codes.c.status == "approved"
    ).values(status="issued"))
    return result.rowcount > 0


async def create_token(conn: AsyncConnection, token_hash: str, machine_id: str, account_id: str) -> None:
    await conn.execute(insert(device_tokens).values(
        token_hash=token_hash, machine_id=machine_id, account_id=account_id, created_at=int(time.time())))


async def token_owner(conn: AsyncConnection, token_hash: str) -> tuple[str, str] | None:
    """(account_id, machine_id) for a live device token of a linked machine."""
    return (await token_owners(conn, [token_hash])).get(token_hash)


async def token_owners(conn: AsyncConnection, token_hashes: list[str]) -> dict[str, tuple[str, str]]:
    """(account_id, machine_id) by token hash, for those of ``token_hashes`` that are live device
    tokens of linked machines (one statement)."""
    rows = await conn.execute(
        select(device_tokens.c.token_hash, device_tokens.c.account_id, device_tokens.c.machine_id)
        .join(machines, machines.c.id == device_tokens.c.machine_id)
        .where(device_tokens.c.token_hash.in_(token_hashes), device_tokens.c.revoked_at.is_(None),
               machines.c.unlinked_at.is_(None)))
    return {row[0]: (row[1], row[2]) for row in rows}


async def revoke_for_machine(conn: AsyncConnection, machine_id: str) -> None:
    await conn.execute(update(device_tokens).where(
        device_tokens.c.machine_id == machine_id, device_tokens.c.revoked_at.is_(None)
    ).values(revoked_at=int(time.time())))
