"""Fresh databases for tests: a temporary SQLite file, or a new database on the machine's Postgres
(created for the caller and dropped afterwards)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path
from typing import Iterator

POSTGRES_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh Postgres database URL, dropped afterwards."""
    name = "darkbloom_test_" + secrets.token_hex(6)
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextlib.contextmanager
def database_for(backend: str, directory: Path) -> Iterator[str]:
    """A fresh database of this backend ("sqlite" or "postgres")."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{directory / 'coordinator.db'}"
    else:
        with postgres_database() as url:
            yield url
