"""A catalog stored through one replica (PUT /v1/admin/catalog) is taken up by the others: they read
the stored one every few seconds (routing/live_catalog.py), so a weight pin or a price change does
not stop at the replica that received it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator

import httpx
import pytest

from darkbloom.coordinator.routing import live_catalog
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
            return data == [{**entry, "aliases": [], "max_output_tokens": 4096}]
        wait_until(on_b, timeout=30, interval=0.2, what="the catalog on the other replica")


async def test_a_read_that_began_before_this_replicas_own_put_does_not_put_the_old_catalog_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The follower reads the stored catalog (the old one); this replica's PUT stores and takes up a new
    one before that read returns: the old one must not come back until the next read."""
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
        if reads == 3:
            raise asyncio.CancelledError
        return stored[0]

    monkeypatch.setattr(live_catalog.stored_settings, "get", read_then_put)
    with pytest.raises(asyncio.CancelledError):
        await live_catalog.follow_catalog(services, interval=0)  # type: ignore[arg-type]
    assert services.settings.catalog is new and reads == 3


class _PostgresLike:
    dialect = SimpleNamespace(name="postgresql")

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[None]:
        yield None
