"""Schema migrations from an empty database, on SQLite and Postgres."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

import darkbloom.store.db as store_db
from darkbloom.store import create_engine, migrate, ping
from darkbloom.store.schema import metadata

TABLES = {"accounts", "console_sessions", "api_keys", "device_codes", "machines", "device_tokens",
          "admin_credits"}


def _head_revision() -> str:
    config = Config()
    config.set_main_option("script_location", str(Path(store_db.__file__).parent / "migrations"))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


async def test_migrate_from_empty_then_again_is_a_no_op(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            assert not (await conn.run_sync(lambda c: set(inspect(c).get_table_names()))) & TABLES

        await migrate(engine)
        await migrate(engine)  # idempotent: already at head

        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
            versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars().all()
        assert TABLES | {"alembic_version"} <= tables
        assert versions == [_head_revision()]
        assert await ping(engine)
    finally:
        await engine.dispose()


async def test_migrated_schema_matches_the_table_definitions(database_url: str) -> None:
    """The migrations and ``schema.py`` describe the same tables (no drift between them)."""
    engine = create_engine(database_url)
    try:
        await migrate(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), metadata))
        assert diff == []
    finally:
        await engine.dispose()


async def test_migrate_keeps_existing_rows(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        await migrate(engine)
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO accounts (id, email, balance_micro_usd, withdrawable_micro_usd, created_at) "
                "VALUES ('acct_kept', 'kept@example.com', 7, 0, 1)"))
        await migrate(engine)
        async with engine.connect() as conn:
            balance = (await conn.execute(text(
                "SELECT balance_micro_usd FROM accounts WHERE id = 'acct_kept'"))).scalar_one()
        assert balance == 7
    finally:
        await engine.dispose()


async def test_ping_reports_an_unreachable_database() -> None:
    engine = create_engine("postgresql+asyncpg://postgres@127.0.0.1:1/nothing_listens_here")
    try:
        assert await ping(engine) is False
    finally:
        await engine.dispose()


@pytest.mark.timeout(120)  # without the lock the replicas' DDL waits on itself until this timeout
@pytest.mark.postgres
def test_replicas_migrating_a_fresh_postgres_at_once_take_turns() -> None:
    """Three coordinator replicas started together against an empty database (a compose file's first
    start): each migrates under the same advisory lock, so one creates the schema and the others find
    it at head, instead of colliding on CREATE TABLE."""
    import asyncio

    from tests.support.databases import postgres_database

    async def together(url: str) -> list[str]:
        engines = [create_engine(url) for _ in range(3)]
        try:
            await asyncio.gather(*(migrate(engine) for engine in engines))
            async with engines[0].connect() as conn:
                return list((await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars().all())
        finally:
            for engine in engines:
                await engine.dispose()

    with postgres_database() as url:
        assert asyncio.run(together(url)) == [_head_revision()]


async def test_migration_0009_deletes_the_sampling_meters_insight_rows_and_keeps_the_others(
        database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: _upgrade_to(c, "0008"))
            for name in ("slots_busy", "slots_total", "tps:12", "slot_ms", "busy_slot_ms", "tps_ms:12",
                         "passed_over:busy"):
                await conn.execute(text("INSERT INTO machine_insight (machine_id, hour, name, value) "
                                        "VALUES ('mach_a', 3600, :name, 1)"), {"name": name})
        await migrate(engine)
        async with engine.connect() as conn:
            names = set((await conn.execute(text("SELECT name FROM machine_insight"))).scalars())
        assert names == {"slot_ms", "busy_slot_ms", "tps_ms:12", "passed_over:busy"}
    finally:
        await engine.dispose()


def _upgrade_to(connection: Any, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(store_db.__file__).parent / "migrations"))
    config.attributes["connection"] = connection
    command.upgrade(config, revision)
