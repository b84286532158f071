"""Machine insight and usage over time: the ``machine_insight`` counters (added to in batches by
every replica) and the sums over usage rows that the stats, the daily usage and the CSV read."""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.schema import machine_insight, usage_records

DAY = 86400


async def add(conn: AsyncConnection, counts: Mapping[tuple[str, int, str], int]) -> None:
    """value += n for each (machine, hour, name), in one statement."""
    if not counts:
        return
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    rows = [{"machine_id": m, "hour": h, "name": n, "value": v} for (m, h, n), v in sorted(counts.items())]
    statement = dialect_insert(machine_insight)
    await conn.execute(statement.on_conflict_do_update(
        index_elements=["machine_id", "hour", "name"],
        set_={"value": machine_insight.c.value + statement.excluded.value}), rows)


async def prune(conn: AsyncConnection, before: int) -> int:
    """Delete the counters of the hours before ``before``; how many rows went."""
    result = await conn.execute(delete(machine_insight).where(machine_insight.c.hour < before))
    return int(result.rowcount or 0)


async def counters(conn: AsyncConnection, machine_id: str, since: int) -> dict[str, int]:
    rows = await conn.execute(
        select(machine_insight.c.name, func.sum(machine_insight.c.value))
        .where(machine_insight.c.machine_id == machine_id, machine_insight.c.hour >= since)
        .group_by(machine_insight.c.name))
    return {name: int(value) for name, value in rows}


async def machine_hours(conn: AsyncConnection, machine_id: str, since: int) -> list[dict[str, Any]]:
    """Per hour (Unix seconds of its start) and route: requests, tokens and the owner's payout."""
    hour = usage_records.c.created_at - usage_records.c.created_at % 3600
    rows = await conn.execute(
        select(hour.label("hour"), usage_records.c.routed, func.count().label("requests"),
               func.sum(usage_records.c.prompt_tokens).label("prompt_tokens"),
               func.sum(usage_records.c.completion_tokens).label("completion_tokens"),
               func.sum(usage_records.c.provider_payout_micro_usd).label("payout"))
        .where(usage_records.c.machine_id == machine_id, usage_records.c.created_at >= since)
        .group_by(hour, usage_records.c.routed))
    return [dict(r) for r in rows.mappings()]


async def daily(conn: AsyncConnection, account_id: str, since: int) -> dict[int, dict[str, int]]:
    """The account's usage per UTC day (Unix day number) since ``since``."""
    day = (usage_records.c.created_at - usage_records.c.created_at % DAY) / DAY
    rows = await conn.execute(
        select(day.label("day"), func.count().label("requests"),
               func.sum(usage_records.c.prompt_tokens).label("prompt_tokens"),
               func.sum(usage_records.c.completion_tokens).label("completion_tokens"),
               func.sum(usage_records.c.cost_micro_usd).label("cost_micro_usd"))
        .where(usage_records.c.account_id == account_id, usage_records.c.created_at >= since)
        .group_by(day))
    return {int(r["day"]): {k: int(r[k] or 0) for k in ("requests", "prompt_tokens", "completion_tokens",
                                                       "cost_micro_usd")} for r in rows.mappings()}


async def usage_rows(conn: AsyncConnection, account_id: str, limit: int,
                     batch: int = 1000) -> AsyncIterator[dict[str, Any]]:
    """The account's usage rows, newest first, at most ``limit``, read ``batch`` at a time (keyset)."""
    before: int | None = None
    left = limit
    while left > 0:
        query = (select(usage_records).where(usage_records.c.account_id == account_id)
                 .order_by(usage_records.c.id.desc()).limit(min(batch, left)))
        if before is not None:
            query = query.where(usage_records.c.id < before)
        rows = [dict(r) for r in (await conn.execute(query)).mappings()]
        for row in rows:
            yield row
        if len(rows) < min(batch, left):
            return
        left -= len(rows)
        before = rows[-1]["id"]


