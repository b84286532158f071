"""Shared fixtures: database URLs (SQLite and the machine's Postgres), real coordinator processes."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.databases import database_for, postgres_database
from tests.support.processes import Coordinator, start_coordinator


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh Postgres database for this test, dropped afterwards."""
    with postgres_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_for(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def coordinator(tmp_path: Path, sqlite_url: str) -> Iterator[Coordinator]:
    """A real coordinator process on SQLite."""
    coord = start_coordinator(tmp_path / "coordinator-home", sqlite_url)
    try:
        yield coord
    finally:
        coord.stop()
