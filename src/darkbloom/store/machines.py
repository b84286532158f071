"""Linked machines: one record per device token minted for an account."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, insert, select, text, update
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


@dataclass(frozen=True, slots=True)
class Seen:
    """What a live session last told of its machine: the columns the coordinator keeps current."""

    last_seen: int
    models: list[str]
    trust_level: str
    private_only: bool
    name: str | None = None          # None: keep the stored one
    identity_key: str | None = None  # None: keep the stored one


async def record_seen(conn: AsyncConnection, seen: Mapping[str, Seen]) -> None:
    """Write many machines' ``Seen`` in one statement (executemany), in id order: replicas writing
    overlapping batches lock the rows in the same order."""
    if not seen:
        return
    statement = update(machines).where(machines.c.id == bindparam("machine_id")).values(
        last_seen=bindparam("seen_last_seen"), models=bindparam("seen_models", type_=machines.c.models.type),
        trust_level=bindparam("seen_trust_level"), private_only=bindparam("seen_private_only"),
        name=func.coalesce(bindparam("seen_name", type_=machines.c.name.type), machines.c.name),
        identity_key=func.coalesce(bindparam("seen_identity_key", type_=machines.c.identity_key.type),
                                   machines.c.identity_key))
    await conn.execute(statement, [
        {"machine_id": machine_id, "seen_last_seen": s.last_seen, "seen_models": s.models,
         "seen_trust_level": s.trust_level, "seen_private_only": s.private_only, "seen_name": s.name,
         "seen_identity_key": s.identity_key}
        for machine_id, s in sorted(seen.items(), key=lambda item: item[0])])


async def record_last_seen(conn: AsyncConnection, last_seen: Mapping[str, int]) -> None:
    """Write many machines' last seen time alone: on Postgres one statement over two
    arrays (an executemany sends and acknowledges every row: ~8× the CPU at 10,000 machines,
    bench/RESULTS.md), elsewhere one executemany."""
    if not last_seen:
        return
    ids = sorted(last_seen)
    if conn.dialect.name == "postgresql":
        await conn.execute(text(
            "UPDATE machines SET last_seen = seen.last_seen"
            " FROM unnest(CAST(:ids AS text[]), CAST(:times AS bigint[])) AS seen(id, last_seen)"
            " WHERE machines.id = seen.id"), {"ids": ids, "times": [last_seen[i] for i in ids]})
    else:
        await conn.execute(
            update(machines).where(machines.c.id == bindparam("machine_id")).values(
                last_seen=bindparam("seen_last_seen")),
            [{"machine_id": machine_id, "seen_last_seen": last_seen[machine_id]} for machine_id in ids])


async def unlink(conn: AsyncConnection, account_id: str, machine_id: str) -> bool:
    result = await conn.execute(update(machines).where(
        machines.c.id == machine_id, machines.c.account_id == account_id, machines.c.unlinked_at.is_(None)
    ).values(unlinked_at=int(time.time())))
    return result.rowcount > 0


async def set_certificate(conn: AsyncConnection, machine_id: str, certificate: str) -> None:
    """Keep the enrollment certificate issued for the machine's identity key."""
    await conn.execute(update(machines).where(machines.c.id == machine_id).values(
        certificate=certificate, enrolled_at=int(time.time())))
