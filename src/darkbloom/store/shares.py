"""Shares and their daily counters. A share names its grantee by email, so one made before the
grantee signs up takes effect when they do: the account is found by email when it is read."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import insert_ignore
from darkbloom.store.insight import DAY
from darkbloom.store.schema import accounts, machines, share_days, shares, usage_records
from darkbloom.wire.crypto import new_id

def utc_day(now: float) -> int:
    return int(now) // DAY


async def create(conn: AsyncConnection, owner_account_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    share_id = new_id("shr_")
    values = {"input_price": 0, "output_price": 0, **fields}
    await insert_ignore(conn, shares, id=share_id, owner_account_id=owner_account_id,
                        created_at=int(time.time()), **values)
    row = await get(conn, share_id)
    assert row is not None
    return row


async def get(conn: AsyncConnection, share_id: str) -> dict[str, Any] | None:
    """A share that is not revoked (expired ones included), with the owner's email."""
    row = (await conn.execute(
        select(shares, accounts.c.email.label("owner_email"))
        .join(accounts, accounts.c.id == shares.c.owner_account_id)
        .where(shares.c.id == share_id, shares.c.revoked_at.is_(None)))).mappings().first()
    return dict(row) if row else None


def _grantee_is(account_id: str) -> Any:
    return shares.c.grantee_email == select(accounts.c.email).where(accounts.c.id == account_id).scalar_subquery()


async def visible_to(conn: AsyncConnection, share_id: str, account_id: str) -> dict[str, Any] | None:
    """The share when ``account_id`` is its owner or its grantee; None for anyone else."""
    row = await get(conn, share_id)
    if row is None:
        return None
    if row["owner_account_id"] == account_id:
        return row
    email = (await conn.execute(select(accounts.c.email).where(accounts.c.id == account_id))).scalar()
    return row if email is not None and email == row["grantee_email"] else None


async def given(conn: AsyncConnection, owner_account_id: str) -> list[dict[str, Any]]:
    rows = await conn.execute(select(shares).where(
        shares.c.owner_account_id == owner_account_id, shares.c.revoked_at.is_(None)
    ).order_by(shares.c.created_at, shares.c.id))
    return [dict(r) for r in rows.mappings()]


async def received(conn: AsyncConnection, grantee_account_id: str, *, now: float | None = None
                   ) -> list[dict[str, Any]]:
    """Shares made to the account's email, not revoked (and, with ``now``, not expired), with the
    owner's email; the owner's own shares to themselves cannot exist (refused at creation)."""
    query = (select(shares, accounts.c.email.label("owner_email"))
             .join(accounts, accounts.c.id == shares.c.owner_account_id)
             .where(_grantee_is(grantee_account_id), shares.c.revoked_at.is_(None))
             .order_by(shares.c.created_at, shares.c.id))
    if now is not None:
        query = query.where(or_(shares.c.expires_at.is_(None), shares.c.expires_at > int(now)))
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def revoke(conn: AsyncConnection, share_id: str, account_id: str) -> bool:
    """Revoke for its owner or its grantee; False when the share is not theirs (or already gone)."""
    if await visible_to(conn, share_id, account_id) is None:
        return False
    result = await conn.execute(update(shares).where(shares.c.id == share_id, shares.c.revoked_at.is_(None))
                                .values(revoked_at=int(time.time())))
    return result.rowcount > 0


async def machine_names(conn: AsyncConnection, owner_account_ids: set[str]) -> dict[str, dict[str, str]]:
    """Linked machines' names per owner: {owner: {mach_id: name}}."""
    if not owner_account_ids:
        return {}
    rows = await conn.execute(select(machines.c.id, machines.c.name, machines.c.account_id).where(
        machines.c.account_id.in_(owner_account_ids), machines.c.unlinked_at.is_(None)))
    out: dict[str, dict[str, str]] = {}
    for machine_id, name, owner in rows:
        out.setdefault(owner, {})[machine_id] = name
    return out


# Daily counters: one row per share and UTC day. A request takes one request and holds its token
# estimate in one conditional UPDATE, so concurrent requests on any replica never overshoot a limit.

async def take(conn: AsyncConnection, share: dict[str, Any], day: int, token_estimate: int) -> bool:
    """Count a request against today's limits; False (nothing taken) when either would be passed."""
    await insert_ignore(conn, share_days, share_id=share["id"], day=day, requests=0, tokens=0, held_tokens=0)
    conditions = [share_days.c.share_id == share["id"], share_days.c.day == day]
    if share["daily_request_limit"] is not None:
        conditions.append(share_days.c.requests < share["daily_request_limit"])
    if share["daily_token_limit"] is not None:
        conditions.append(share_days.c.tokens + share_days.c.held_tokens + token_estimate
                          <= share["daily_token_limit"])
    result = await conn.execute(update(share_days).where(and_(*conditions)).values(
        requests=share_days.c.requests + 1, held_tokens=share_days.c.held_tokens + token_estimate))
    return result.rowcount > 0


async def settle(conn: AsyncConnection, share_id: str, day: int, token_estimate: int, tokens_used: int) -> None:
    """The request's estimate becomes what it used."""
    await conn.execute(update(share_days).where(share_days.c.share_id == share_id, share_days.c.day == day).values(
        tokens=share_days.c.tokens + tokens_used, held_tokens=share_days.c.held_tokens - token_estimate))


async def give_back(conn: AsyncConnection, share_id: str, day: int, token_estimate: int) -> None:
    """A request that was never served: its request and its estimate go back."""
    await conn.execute(update(share_days).where(share_days.c.share_id == share_id, share_days.c.day == day).values(
        requests=share_days.c.requests - 1, held_tokens=share_days.c.held_tokens - token_estimate))


async def used_on(conn: AsyncConnection, share_id: str, day: int) -> dict[str, int]:
    row = (await conn.execute(select(share_days).where(
        share_days.c.share_id == share_id, share_days.c.day == day))).mappings().first()
    return {"requests": int(row["requests"]), "tokens": int(row["tokens"])} if row else {"requests": 0, "tokens": 0}


async def usage_rows(conn: AsyncConnection, share_id: str, limit: int) -> list[dict[str, Any]]:
    rows = await conn.execute(select(usage_records).where(usage_records.c.share_id == share_id)
                              .order_by(usage_records.c.id.desc()).limit(limit))
    return [dict(r) for r in rows.mappings()]


async def usage_today(conn: AsyncConnection, share_id: str, day: int) -> dict[str, int]:
    """Today's settled use through the share, from its usage rows (prompt and completion apart)."""
    row = (await conn.execute(select(
        func.count(), func.coalesce(func.sum(usage_records.c.prompt_tokens), 0),
        func.coalesce(func.sum(usage_records.c.completion_tokens), 0)
    ).where(usage_records.c.share_id == share_id, usage_records.c.created_at >= day * DAY))).first()
    assert row is not None
    return {"requests": int(row[0]), "prompt_tokens": int(row[1]), "completion_tokens": int(row[2])}
