"""Shares and their daily counters. A share names its grantee by email and routes nothing until an
account answers it (docs/sharing.md "Consent"): the account that redeems its invite code, or the one
whose verified address it names. That account is then its grantee; until then, nobody is."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import insert_ignore
from darkbloom.store.insight import DAY
from darkbloom.store.schema import accounts, machines, share_days, shares, usage_records
from darkbloom.wire.crypto import new_id

STATUSES = ("pending", "accepted", "declined")
TERMS = ("machine_ids", "input_price", "output_price")  # what a grantee consents to: a change asks again


def utc_day(now: float) -> int:
    return int(now) // DAY


async def create(conn: AsyncConnection, owner_account_id: str, fields: dict[str, Any],
                 invite_code_hash: str) -> dict[str, Any]:
    share_id = new_id("shr_")
    values = {"input_price": 0, "output_price": 0, **fields}
    await insert_ignore(conn, shares, id=share_id, owner_account_id=owner_account_id,
                        created_at=int(time.time()), status="pending", invite_code_hash=invite_code_hash,
                        **values)
    row = await get(conn, share_id)
    assert row is not None
    return row


async def get(conn: AsyncConnection, share_id: str) -> dict[str, Any] | None:
    """A share that is not revoked (expired ones included), with the owner's email."""
    row = (await conn.execute(_with_owner_email().where(shares.c.id == share_id))).mappings().first()
    return dict(row) if row else None


def _with_owner_email() -> Any:
    """Shares not revoked, each with its owner's email."""
    return (select(shares, accounts.c.email.label("owner_email"))
            .join(accounts, accounts.c.id == shares.c.owner_account_id).where(shares.c.revoked_at.is_(None)))


def _verified_email_of(account_id: str) -> Any:
    return (select(accounts.c.email)
            .where(accounts.c.id == account_id, accounts.c.email_verified_at.is_not(None)).scalar_subquery())


def _received_by(account_id: str) -> Any:
    """Answered by the account, or answered by nobody yet and addressed to its verified email."""
    return or_(shares.c.grantee_account_id == account_id,
               and_(shares.c.grantee_account_id.is_(None), shares.c.grantee_email == _verified_email_of(account_id)))


async def addressed_to(conn: AsyncConnection, share_id: str, account_id: str) -> dict[str, Any] | None:
    """The share when ``account_id`` answered it, or nobody did and it names the account's email,
    verified or not (the caller tells the two apart: an unverified address may not answer it)."""
    row = await get(conn, share_id)
    if row is None or row["owner_account_id"] == account_id:
        return None
    if row["grantee_account_id"] is not None:
        return row if row["grantee_account_id"] == account_id else None
    email = (await conn.execute(select(accounts.c.email).where(accounts.c.id == account_id))).scalar()
    return row if email is not None and email == row["grantee_email"] else None


async def visible_to(conn: AsyncConnection, share_id: str, account_id: str) -> dict[str, Any] | None:
    """The share when ``account_id`` is its owner or has received it; None for anyone else."""
    row = (await conn.execute(_with_owner_email().where(
        shares.c.id == share_id, or_(shares.c.owner_account_id == account_id, _received_by(account_id))
    ))).mappings().first()
    return dict(row) if row else None


async def given(conn: AsyncConnection, owner_account_id: str) -> list[dict[str, Any]]:
    rows = await conn.execute(select(shares).where(
        shares.c.owner_account_id == owner_account_id, shares.c.revoked_at.is_(None)
    ).order_by(shares.c.created_at, shares.c.id))
    return [dict(r) for r in rows.mappings()]


async def received(conn: AsyncConnection, grantee_account_id: str, *, usable_at: float | None = None
                   ) -> list[dict[str, Any]]:
    """Shares the account received, not revoked, with the owner's email; with ``usable_at``, only
    those it accepted that have not expired by then (what shared routing may use). The owner's own
    shares to themselves cannot exist (refused at creation)."""
    if usable_at is None:
        condition = _received_by(grantee_account_id)
    else:
        condition = and_(shares.c.grantee_account_id == grantee_account_id, shares.c.status == "accepted",
                         or_(shares.c.expires_at.is_(None), shares.c.expires_at > int(usable_at)))
    query = _with_owner_email().where(condition).order_by(shares.c.created_at, shares.c.id)
    return [dict(r) for r in (await conn.execute(query)).mappings()]


async def answer(conn: AsyncConnection, share_id: str, account_id: str, status: str,
                 shown: dict[str, Any]) -> bool:
    """The account accepts or declines the share, which becomes its own (its invite code is spent);
    False when another account answered it first or its terms differ from ``shown`` (the terms the
    grantee saw: any of TERMS), so nobody accepts prices they were not shown. The row is locked
    from the check to the write, against an owner changing the terms in between."""
    row = (await conn.execute(select(shares).where(shares.c.id == share_id, shares.c.revoked_at.is_(None))
                              .with_for_update())).mappings().first()
    if row is None or row["grantee_account_id"] not in (None, account_id):
        return False
    if any(row[name] != value for name, value in shown.items()):
        return False
    await conn.execute(update(shares).where(shares.c.id == share_id).values(
        status=status, grantee_account_id=account_id, invite_code_hash=None, answered_at=int(time.time())))
    return True


async def redeem(conn: AsyncConnection, invite_code_hash: str, account_id: str) -> str | None:
    """The share whose invite code this is, accepted by and now bound to ``account_id``; None for a
    wrong or spent code (or the owner's own)."""
    share_id = (await conn.execute(select(shares.c.id).where(
        shares.c.invite_code_hash == invite_code_hash, shares.c.revoked_at.is_(None),
        shares.c.owner_account_id != account_id))).scalar()
    if share_id is None:
        return None
    result = await conn.execute(update(shares).where(
        shares.c.id == share_id, shares.c.invite_code_hash == invite_code_hash).values(
        status="accepted", grantee_account_id=account_id, invite_code_hash=None, answered_at=int(time.time())))
    return str(share_id) if result.rowcount > 0 else None


async def change(conn: AsyncConnection, share_id: str, owner_account_id: str,
                 fields: dict[str, Any]) -> dict[str, Any] | None:
    """The owner changes a share; a change of its terms (TERMS) puts it back to pending, so its
    grantee is asked again. None when the share is not the owner's."""
    row = (await conn.execute(select(shares).where(shares.c.id == share_id, shares.c.revoked_at.is_(None))
                              .with_for_update())).mappings().first()
    if row is None or row["owner_account_id"] != owner_account_id:
        return None
    values = dict(fields)
    if any(name in fields and fields[name] != row[name] for name in TERMS):
        values["status"] = "pending"
    if values:
        await conn.execute(update(shares).where(shares.c.id == share_id).values(**values))
    return await get(conn, share_id)


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
