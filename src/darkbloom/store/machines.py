"""Linked machines: one record per device token minted for an account."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.wire.crypto import new_id
from darkbloom.store.schema import machines


async def create(conn: AsyncConnection, account_id: str, name: str) -> str:
    machine_id = new_id("mach_")
    await conn.execute(insert(machines).values(
        id=machine_id, account_id=account_id, name=name, trust_level="none", private_only=False,
        models=[], created_at=int(time.time())))
    return machine_id


async def get(conn: AsyncConnection, machine_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(machines).where(machines.c.id == machine_id))).mappings().first()
    return dict(row) if row else None


async def list_for(conn: AsyncConnection, account_id: str) -> list[dict[str, Any]]:
    rows = await conn.execute(select(machines).where(
        machines.c.account_id == account_id, machines.c.unlinked_at.is_(None)).order_by(machines.c.created_at,
                                                                                       machines.c.id))
    return [dict(r) for r in rows.mappings()]


async def ever_linked(conn: AsyncConnection, account_id: str) -> bool:
    """Whether any machine was ever linked to the account (unlinked ones included)."""
    row = (await conn.execute(select(machines.c.id).where(machines.c.account_id == account_id).limit(1))).first()
    return row is not None


async def record_seen(conn: AsyncConnection, machine_id: str, *, models: list[str] | None = None,
                      trust_level: str | None = None, private_only: bool | None = None,
                      name: str | None = None, identity_key: str | None = None) -> None:
    values: dict[str, Any] = {"last_seen": int(time.time())}
    for key, value in (("models", models), ("trust_level", trust_level), ("private_only", private_only),
                       ("name", name), ("identity_key", identity_key)):
        if value is not None:
            values[key] = value
    await conn.execute(update(machines).where(machines.c.id == machine_id).values(**values))


async def unlink(conn: AsyncConnection, account_id: str, machine_id: str) -> bool:
    result = await conn.execute(update(machines).where(
        machines.c.id == machine_id, machines.c.account_id == account_id, machines.c.unlinked_at.is_(None)
    ).values(unlinked_at=int(time.time())))
    return result.rowcount > 0


async def set_certificate(conn: AsyncConnection, machine_id: str, certificate: str) -> None:
    """Keep the enrollment certificate issued for the machine's identity key."""
    await conn.execute(update(machines).where(machines.c.id == machine_id).values(
        certificate=certificate, enrolled_at=int(time.time())))
