"""Files (OpenAI's Files API): an account's uploads and the result files of its batches, content
stored in the row, every read scoped to the owning account."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.store.db import newest_first
from darkbloom.store.schema import files
from darkbloom.wire.crypto import new_id

_LISTED = (files.c.id, files.c.account_id, files.c.purpose, files.c.filename, files.c.bytes, files.c.lines,
           files.c.created_at)


async def create(conn: AsyncConnection, account_id: str, purpose: str, filename: str, content: bytes,
                 lines: int | None = None) -> dict[str, Any]:
    row = {"id": new_id("file-"), "account_id": account_id, "purpose": purpose, "filename": filename,
           "bytes": len(content), "lines": lines, "created_at": int(time.time())}
    await conn.execute(insert(files).values(**row, content=content))
    return row


async def get(conn: AsyncConnection, account_id: str, file_id: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(*_LISTED).where(files.c.id == file_id, files.c.account_id == account_id))
           ).mappings().first()
    return dict(row) if row else None


async def content(conn: AsyncConnection, account_id: str, file_id: str) -> bytes | None:
    return (await conn.execute(select(files.c.content).where(files.c.id == file_id,
                                                             files.c.account_id == account_id))).scalar()


async def list_for(conn: AsyncConnection, account_id: str, limit: int, after_id: str | None,
                   purpose: str | None) -> list[dict[str, Any]]:
    """Newest first; ``after_id``: those listed after that file."""
    query = select(*_LISTED).where(files.c.account_id == account_id)
    if purpose is not None:
        query = query.where(files.c.purpose == purpose)
    return await newest_first(conn, query, files, account_id, after_id, limit)


async def remove(conn: AsyncConnection, account_id: str, file_id: str) -> bool:
    result = await conn.execute(delete(files).where(files.c.id == file_id, files.c.account_id == account_id))
    return result.rowcount > 0
