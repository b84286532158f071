"""Billing tests: in-process coordinator services on SQLite and Postgres (``database_url``), and
helpers that read the money tables straight from a coordinator's database."""

from __future__ import annotations

import secrets
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy import func, select

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.identity.api_keys import ApiKey
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts, create_engine, keys, migrate
from darkbloom.store.schema import key_spend, ledger_entries, reservations, usage_records

# Prices with fractional µUSD per token, so the per-part ceiling of the cost (docs/billing.md "Money") is visible.
PRICED = CatalogModel(id="priced-model", input_price=1_333_333, output_price=4_666_667, max_output_tokens=256)

MakeServices = Callable[..., Awaitable[Services]]


@pytest.fixture
async def make_services(database_url: str) -> AsyncIterator[MakeServices]:
    """Build coordinator services on the test database (migrated); each call is one coordinator
    instance with its own engine and instance id. Settings are keyword overrides."""
    built: list[Services] = []

    async def make(**settings: Any) -> Services:
        engine = create_engine(database_url)
        await migrate(engine)
        config = CoordinatorSettings(database_url=database_url, **settings)
        registry = Registry()
        services = Services(settings=config, engine=engine, registry=registry, rate_limiter=MemoryRateLimiter())
        built.append(services)
        return services

    try:
        yield make
    finally:
        for services in built:
            await services.ledger.close()
            await services.engine.dispose()


@pytest.fixture
async def services(make_services: MakeServices) -> Services:
    return await make_services()


async def new_account(services: Services, credit: int = 0) -> str:
    """An account with ``credit`` µUSD put in through a (ledgered) admin credit."""
    async with services.engine.begin() as conn:
        account_id = await accounts.create_account(conn, f"u-{secrets.token_hex(5)}@example.com", "hash")
        if credit:
            await accounts.credit(conn, account_id, credit, "ref-" + secrets.token_hex(6))
    return account_id


async def new_key(services: Services, account_id: str, **fields: Any) -> ApiKey:
    async with services.engine.begin() as conn:
        return ApiKey.from_row(await keys.create(conn, account_id, secrets.token_hex(32), "dk-test",
                                                 {"name": "test", **fields}))


async def pockets(services: Services, account_id: str) -> tuple[int, int]:
    """(balance, withdrawable) of an account."""
    async with services.engine.connect() as conn:
        row = await accounts.get(conn, account_id)
    assert row is not None
    return int(row["balance_micro_usd"]), int(row["withdrawable_micro_usd"])


async def rows(services_or_engine: Any, table: Any, *where: Any) -> list[dict[str, Any]]:
    engine = getattr(services_or_engine, "engine", services_or_engine)
    query = select(table)
    for clause in where:
        query = query.where(clause)
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(query)).mappings()]


async def ledger_for(services: Services, request_id: str) -> list[dict[str, Any]]:
    return sorted(await rows(services, ledger_entries, ledger_entries.c.request_id == request_id),
                  key=lambda r: r["id"])


async def counts(engine: Any) -> dict[str, int]:
    """Row counts of the money tables (to show that a refused step left no trace)."""
    out = {}
    async with engine.connect() as conn:
        for table in (ledger_entries, reservations, usage_records, key_spend):
            out[table.name] = int((await conn.execute(select(func.count()).select_from(table))).scalar() or 0)
    return out
