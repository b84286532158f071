"""Stored settings: one JSON value per name, shared by every replica (the live catalog, the
consumer encryption key, the enrollment CA)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import stored_settings


async def get(conn: AsyncConnection, name: str) -> Any | None:
    row = (await conn.execute(select(stored_settings.c.value).where(stored_settings.c.name == name))).first()
    return row[0] if row is not None else None


async def add(conn: AsyncConnection, name: str, value: Any) -> bool:
    """Store ``value`` unless ``name`` already has one; True when this call stored it."""
    return await insert_ignore(conn, stored_settings, name=name, value=value)


async def put(conn: AsyncConnection, name: str, value: Any) -> None:
    if not await add(conn, name, value):
        await conn.execute(update(stored_settings).where(stored_settings.c.name == name).values(value=value))
