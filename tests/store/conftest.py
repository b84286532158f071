"""A migrated engine on each backend (the ``database_url`` fixture covers SQLite and Postgres)."""

from __future__ import annotations

from typing import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store import create_engine, migrate


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    await migrate(engine)
    try:
        yield engine
    finally:
        await engine.dispose()
