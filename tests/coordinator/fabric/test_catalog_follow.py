"""A catalog stored through one replica (PUT /v1/admin/catalog) is taken up by the others: the store
is announced on Postgres (store/notices.py) and each other replica reads the stored one when told
and whenever its listener starts listening (routing/live_catalog.py), so a weight pin or a price
change does not stop at the replica that received it — and nothing polls the database meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator, Callable

import httpx
import pytest

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.routing import live_catalog
from darkbloom.coordinator.services import Services
from darkbloom.store import create_engine, migrate, notices
from darkbloom.wire.catalog import Catalog, CatalogModel
from tests.support.processes import wait_until
from tests.support.replicas import replica_set


@pytest.mark.e2e
def test_a_catalog_put_on_one_replica_reaches_the_other(tmp_path: Path) -> None:
    with replica_set(tmp_path, 2) as replicas:
        a, b = replicas.coordinators
        entry = {"id": "smollm2-135m", "input_price": 7, "output_price": 11, "weight_hash": "sha256:" + "c" * 64,
                 "context_length": 4096}
        stored = httpx.put(a.api_url + "/admin/catalog", headers=a.admin(), json={"models": [entry]}, timeout=30)
        assert stored.status_code == 200, stored.text

        def on_b() -> bool:
            data = httpx.get(b.api_url + "/models/catalog", timeout=10).json()["data"]
            return data == [{**entry, "aliases": [], "max_output_tokens": 4096, "format": "gguf"}]
        wait_until(on_b, timeout=30, interval=0.2, what="the catalog on the other replica")


async def test_a_catalog_stored_here_is_taken_up_there_when_announced(postgres_url: str) -> None:
    new = Catalog(models=[CatalogModel(id="smollm2-135m", input_price=7, output_price=11)])
    async with _two_replicas(postgres_url) as (here, there, start_listening):
        listener = start_listening()
        await _eventually(lambda: listener.listening)
        await live_catalog.store_catalog(here, new)
        await _eventually(lambda: there.settings.catalog == new)


async def test_a_catalog_stored_while_not_listening_is_read_when_listening_starts(postgres_url: str) -> None:
    new = Catalog(models=[CatalogModel(id="smollm2-135m", input_price=3, output_price=5)])
    async with _two_replicas(postgres_url) as (here, there, start_listening):
        await live_catalog.store_catalog(here, new)  # no listener yet: this notice reaches nobody
        start_listening()
        await _eventually(lambda: there.settings.catalog == new)


@contextlib.asynccontextmanager
async def _two_replicas(database_url: str) -> AsyncIterator[
        tuple[Services, Services, Callable[[], notices.Listener]]]:
    """Two coordinators' services on one database, and a way to start the second's catalog listener."""
    here, there = await _services(database_url), await _services(database_url)
    tasks: list[asyncio.Task[None]] = []

    def start_listening() -> notices.Listener:
        listener = notices.Listener(there.engine)
        live_catalog.subscribe(there, listener)
        tasks.append(asyncio.create_task(listener.run()))
        return listener

    try:
        yield here, there, start_listening
    finally:
        for task in tasks:
            task.cancel()
        await here.engine.dispose()
        await there.engine.dispose()


async def _services(database_url: str) -> Services:
    engine = create_engine(database_url)
    await migrate(engine)
    return Services(settings=CoordinatorSettings(database_url=database_url), engine=engine,
                    registry=Registry(), rate_limiter=MemoryRateLimiter())


async def _eventually(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_read_that_began_before_this_replicas_own_put_does_not_put_the_old_catalog_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The follower reads the stored catalog (the old one); this replica's PUT stores and takes up a new
    one before that read returns: the old one must not come back (the PUT's own notice reads again)."""
    old = Catalog(models=[CatalogModel(id="smollm2-135m", input_price=1, output_price=1)])
    new = Catalog(models=[CatalogModel(id="smollm2-135m", input_price=7, output_price=11)])
    services = SimpleNamespace(engine=_PostgresLike(), settings=SimpleNamespace(catalog=old),
                               registry=SimpleNamespace(close_views=lambda: None))
    stored = [old.model_dump()]
    reads = 0

    async def read_then_put(_conn: object, _name: str) -> dict[str, object]:
        nonlocal reads
        reads += 1
        if reads == 1:  # the PUT lands while this read is on its way back
            seen, stored[0] = stored[0], new.model_dump()
            live_catalog._use(services, new)  # type: ignore[arg-type]
            return seen
        return stored[0]

    monkeypatch.setattr(live_catalog.stored_settings, "get", read_then_put)
    await live_catalog.follow_once(services)  # type: ignore[arg-type]
    assert services.settings.catalog is new and reads == 1
    await live_catalog.follow_once(services)  # type: ignore[arg-type]
    assert services.settings.catalog is new and reads == 2


class _PostgresLike:
    dialect = SimpleNamespace(name="postgresql")

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[None]:
        yield None
