"""Engine creation and schema migration; one code path for SQLite and Postgres."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from typing import Any

from sqlalchemy import Select, Table, and_, event, or_, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

_MIGRATIONS = Path(__file__).parent / "migrations"


def create_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        _ensure_sqlite_dir(url)
        engine = create_async_engine(url, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)


def _ensure_sqlite_dir(url: str) -> None:
    path = url.split(":///", 1)[-1]
    if path and path != ":memory:":
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


# pg_advisory_xact_lock key of schema migrations ("dbmg"): replicas starting together take turns
MIGRATION_LOCK = 0x64626D67


async def migrate(engine: AsyncEngine) -> None:
    """Bring the schema to the newest revision (runs at coordinator start). On Postgres, replicas
    starting at the same moment migrate one after the other (the later ones then find nothing to do)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        await conn.run_sync(_upgrade)


async def ping(engine: AsyncEngine) -> bool:
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        return True
    except Exception:  # noqa: BLE001 - readiness reports any failure as not ready
        return False


async def insert_ignore(conn: AsyncConnection, table: Table, **values: object) -> bool:
    """INSERT … ON CONFLICT DO NOTHING on either backend; True when a row was inserted."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    result = await conn.execute(dialect_insert(table).values(**values).on_conflict_do_nothing())
    return result.rowcount > 0


async def newest_first(conn: AsyncConnection, query: Select[Any], table: Table, account_id: str,
                       after_id: str | None, limit: int) -> list[dict[str, Any]]:
    """``query``'s rows of ``table`` (with ``id``, ``account_id`` and ``created_at``), newest first; with
    ``after_id``, those listed after that row of the account's (none when it is not the account's)."""
    if after_id is not None:
        after = (await conn.execute(select(table.c.created_at).where(
            table.c.id == after_id, table.c.account_id == account_id))).scalar()
        if after is None:
            return []
        query = query.where(or_(table.c.created_at < after, and_(table.c.created_at == after, table.c.id < after_id)))
    query = query.order_by(table.c.created_at.desc(), table.c.id.desc()).limit(limit)
    return [dict(r) for r in (await conn.execute(query)).mappings()]
