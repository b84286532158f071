"""Shared fixtures: database URLs (SQLite and the machine's Postgres), real coordinator processes."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.processes import Coordinator, start_coordinator

POSTGRES_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


async def _admin_execute(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh Postgres database for this test, dropped afterwards."""
    name = "darkbloom_test_" + secrets.token_hex(6)
    asyncio.run(_admin_execute(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(_admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"
    else:
        yield request.getfixturevalue("postgres_url")


@pytest.fixture
def coordinator(tmp_path: Path, sqlite_url: str) -> Iterator[Coordinator]:
    """A real coordinator process on SQLite."""
    coord = start_coordinator(tmp_path / "coordinator-home", sqlite_url)
    try:
        yield coord
    finally:
        coord.stop()
