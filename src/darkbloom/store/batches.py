"""Batches and their lines (OpenAI's Batch API). A line is run by the coordinator instance that holds
its lease: every change of a running line is conditional on that lease (owner and attempt), so two
instances never both finish one line, and a line whose lease ran out is taken over by anyone."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import newest_first
from darkbloom.store.schema import batch_lines, batches, usage_records

OPEN = ("validating", "in_progress", "cancelling", "finalizing")
_INSERT_CHUNK = 1000


async def create(conn: AsyncConnection, row: dict[str, Any], lines: Iterable[tuple[int, str, str]]) -> None:
    """The batch and its lines (line number, custom_id, body), all pending."""
    await conn.execute(insert(batches).values(**row, completed=0, failed=0))
    chunk: list[dict[str, Any]] = []
    for line_no, custom_id, body in lines:
        chunk.append({"batch_id": row["id"], "line_no": line_no, "custom_id": custom_id, "body": body,
                      "state": "pending", "not_before": 0, "attempts": 0})
        if len(chunk) == _INSERT_CHUNK:
            await conn.execute(insert(batch_lines), chunk)
            chunk = []
    if chunk:
        await conn.execute(insert(batch_lines), chunk)


async def get(conn: AsyncConnection, account_id: str | None, batch_id: str) -> dict[str, Any] | None:
    """The batch (``account_id`` None: whoever owns it)."""
    query = select(batches).where(batches.c.id == batch_id)
    if account_id is not None:
        query = query.where(batches.c.account_id == account_id)
    row = (await conn.execute(query)).mappings().first()
    return dict(row) if row else None


async def list_for(conn: AsyncConnection, account_id: str, limit: int, after_id: str | None) -> list[dict[str, Any]]:
    """Newest first; ``after_id``: those listed after that batch."""
    return await newest_first(conn, select(batches).where(batches.c.account_id == account_id), batches, account_id,
                              after_id, limit)


async def open_batches(conn: AsyncConnection) -> list[dict[str, Any]]:
    return [dict(r) for r in (await conn.execute(select(batches).where(batches.c.status.in_(OPEN))
                                                 .order_by(batches.c.created_at))).mappings()]


async def set_status(conn: AsyncConnection, batch_id: str, old: str | tuple[str, ...], new: str, *,
                     stale_before: int | None = None, **times: int) -> bool:
    """``old`` (one status, or any of several) → ``new`` with its timestamps, only if the batch is still
    there (and, with ``stale_before``, was finalizing since before then)."""
    query = update(batches).where(batches.c.id == batch_id,
                                  batches.c.status.in_((old,) if isinstance(old, str) else old))
    if stale_before is not None:
        query = query.where(batches.c.finalizing_at < stale_before)
    result = await conn.execute(query.values(status=new, **times))
    return result.rowcount > 0


def _takeable(now: int) -> Any:
    return or_(and_(batch_lines.c.state == "pending", batch_lines.c.not_before <= now),
               and_(batch_lines.c.state == "running", batch_lines.c.lease_until < now))


async def claim(conn: AsyncConnection, batch_id: str, owner: str, now: int, lease_until: int,
                limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` lines to run — pending ones that may be tried, and running ones whose lease ran
    out — each leased to ``owner`` (its attempt counted) unless another instance took it first."""
    found = (await conn.execute(select(batch_lines.c.line_no).where(batch_lines.c.batch_id == batch_id, _takeable(now))
                                .order_by(batch_lines.c.line_no).limit(limit))).scalars().all()
    claimed = []
    for line_no in found:
        result = await conn.execute(
            update(batch_lines).where(batch_lines.c.batch_id == batch_id, batch_lines.c.line_no == line_no,
                                      _takeable(now))
            .values(state="running", lease_owner=owner, lease_until=lease_until, attempts=batch_lines.c.attempts + 1))
        if result.rowcount:
            row = (await conn.execute(select(batch_lines.c.line_no, batch_lines.c.custom_id, batch_lines.c.body,
                                             batch_lines.c.attempts)
                                      .where(batch_lines.c.batch_id == batch_id, batch_lines.c.line_no == line_no))
                   ).mappings().one()
            claimed.append(dict(row))
    return claimed


async def renew(conn: AsyncConnection, batch_id: str, owner: str, lease_until: int) -> None:
    """Every running line of the batch that ``owner`` holds keeps its lease until ``lease_until``."""
    await conn.execute(update(batch_lines).where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "running",
                                                 batch_lines.c.lease_owner == owner)
                       .values(lease_until=lease_until))


def _held(batch_id: str, line_no: int, owner: str, attempt: int) -> Any:
    return and_(batch_lines.c.batch_id == batch_id, batch_lines.c.line_no == line_no,
                batch_lines.c.state == "running", batch_lines.c.lease_owner == owner,
                batch_lines.c.attempts == attempt)


async def finish(conn: AsyncConnection, batch_id: str, line_no: int, owner: str, attempt: int, state: str,
                 request_id: str | None, result: str, now: int) -> bool:
    """A running line held by ``owner`` (this attempt) → answered | failed, with its file line; its
    batch's count follows. False: the lease was lost, nothing changed."""
    done = await conn.execute(update(batch_lines).where(_held(batch_id, line_no, owner, attempt))
                              .values(state=state, request_id=request_id, result=result, finished_at=now,
                                      lease_owner=None, lease_until=None))
    if not done.rowcount:
        return False
    counter = batches.c.completed if state == "answered" else batches.c.failed
    await conn.execute(update(batches).where(batches.c.id == batch_id).values({counter: counter + 1}))
    return True


async def put_back(conn: AsyncConnection, batch_id: str, line_no: int, owner: str, attempt: int,
                   not_before: int) -> None:
    """A running line that could not run now waits, pending, until ``not_before``."""
    await conn.execute(update(batch_lines).where(_held(batch_id, line_no, owner, attempt))
                       .values(state="pending", not_before=not_before, lease_owner=None, lease_until=None))


async def end_unstarted(conn: AsyncConnection, batch_id: str, state: str, now: int) -> int:
    """Every line not running (pending, or running on a lease that ran out) → ``state`` (expired |
    cancelled); how many."""
    result = await conn.execute(update(batch_lines).where(
        batch_lines.c.batch_id == batch_id,
        or_(batch_lines.c.state == "pending", and_(batch_lines.c.state == "running", batch_lines.c.lease_until < now)))
                                .values(state=state, finished_at=now, lease_owner=None, lease_until=None))
    return result.rowcount


async def unfinished(conn: AsyncConnection, batch_id: str) -> int:
    """Its lines still pending or running."""
    return (await conn.execute(select(func.count()).select_from(batch_lines).where(
        batch_lines.c.batch_id == batch_id, batch_lines.c.state.in_(("pending", "running"))))).scalar_one()


async def stream_lines(conn: AsyncConnection, batch_id: str) -> Iterator[dict[str, Any]]:
    """Its finished lines in order: line number, custom_id, state, request_id, result."""
    rows = await conn.execute(select(batch_lines.c.line_no, batch_lines.c.custom_id, batch_lines.c.state,
                                     batch_lines.c.request_id, batch_lines.c.result)
                              .where(batch_lines.c.batch_id == batch_id).order_by(batch_lines.c.line_no))
    return (dict(r) for r in rows.mappings())


async def charges(conn: AsyncConnection, batch_id: str) -> dict[str, int]:
    """What each of its lines' requests was charged, from the usage rows (request id → µUSD)."""
    rows = await conn.execute(select(usage_records.c.request_id, usage_records.c.cost_micro_usd)
                              .where(usage_records.c.batch_id == batch_id))
    return {request_id: cost for request_id, cost in rows}


async def cost_of(conn: AsyncConnection, batch_ids: list[str]) -> dict[str, int]:
    """What each batch's lines were charged so far (batch id → µUSD; absent: nothing)."""
    if not batch_ids:
        return {}
    rows = await conn.execute(select(usage_records.c.batch_id, func.sum(usage_records.c.cost_micro_usd))
                              .where(usage_records.c.batch_id.in_(batch_ids)).group_by(usage_records.c.batch_id))
    return {batch_id: int(total or 0) for batch_id, total in rows}


async def close(conn: AsyncConnection, batch_id: str, status: str, output_file_id: str | None,
                error_file_id: str | None, completed: int, failed: int, now: int) -> bool:
    """finalizing → ``status`` (completed | expired | cancelled) with its files and final counts."""
    result = await conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.status == "finalizing")
                                .values({"status": status, "output_file_id": output_file_id,
                                         "error_file_id": error_file_id, "completed": completed, "failed": failed,
                                         f"{status}_at": now}))
    return result.rowcount > 0
