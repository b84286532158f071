"""Consumer API keys: only the SHA-256 hash of the secret is stored."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.wire.crypto import new_id
from darkbloom.store.schema import api_keys

EDITABLE_FIELDS = ("name", "self_route_only", "shared_only", "limit_micro_usd", "limit_reset",
                   "fallback_limit_micro_usd", "fallback_limit_reset", "expires_at", "disabled", "rpm_limit",
                   "itpm_limit", "otpm_limit", "allowed_models", "max_shared_price")


async def create(conn: AsyncConnection, account_id: str, key_hash: str, key_prefix: str,
                 fields: dict[str, Any]) -> dict[str, Any]:
    key_id = new_id("key_")
    values = {"self_route_only": False, "shared_only": False, "limit_reset": "none", "disabled": False,
              "fallback_limit_reset": "none", **fields}
    await conn.execute(insert(api_keys).values(
        id=key_id, account_id=account_id, key_hash=key_hash, key_prefix=key_prefix,
        created_at=int(time.time()), **values))
    row = await get(conn, account_id, key_id)
    assert row is not None
    return row


async def get(conn: AsyncConnection, account_id: str, key_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(api_keys).where(
        api_keys.c.id == key_id, api_keys.c.account_id == account_id, api_keys.c.revoked_at.is_(None)
    ))).mappings().first()
    return dict(row) if row else None


async def by_hash(conn: AsyncConnection, key_hash: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(api_keys).where(
        api_keys.c.key_hash == key_hash, api_keys.c.revoked_at.is_(None)))).mappings().first()
    return dict(row) if row else None


async def list_for(conn: AsyncConnection, account_id: str, limit: int,
                   after_id: str | None) -> list[dict[str, Any]]:
    query = (select(api_keys)
             .where(api_keys.c.account_id == account_id, api_keys.c.revoked_at.is_(None))
             .order_by(api_keys.c.id).limit(limit))
    if after_id:
        query = query.where(api_keys.c.id > after_id)
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def update_fields(conn: AsyncConnection, account_id: str, key_id: str,
                        fields: dict[str, Any]) -> dict[str, Any] | None:
    if fields:
        await conn.execute(update(api_keys).where(
            api_keys.c.id == key_id, api_keys.c.account_id == account_id, api_keys.c.revoked_at.is_(None)
        ).values(**fields))
    return await get(conn, account_id, key_id)


async def revoke(conn: AsyncConnection, account_id: str, key_id: str) -> bool:
    result = await conn.execute(update(api_keys).where(
        api_keys.c.id == key_id, api_keys.c.account_id == account_id, api_keys.c.revoked_at.is_(None)
    ).values(revoked_at=int(time.time())))
    return result.rowcount > 0


async def rotate(conn: AsyncConnection, account_id: str, key_id: str, key_hash: str, key_prefix: str) -> bool:
    """A new secret for the same key (its id and settings stay); the old secret's hash is gone."""
    result = await conn.execute(update(api_keys).where(
        api_keys.c.id == key_id, api_keys.c.account_id == account_id, api_keys.c.revoked_at.is_(None)
    ).values(key_hash=key_hash, key_prefix=key_prefix))
    return result.rowcount > 0
