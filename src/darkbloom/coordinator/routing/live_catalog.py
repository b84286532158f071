"""The live catalog: the --catalog file when given, else the last one stored by the admin API,
else the built-in default. PUT /v1/admin/catalog stores it so restarts and replicas agree: every
replica on a shared database reads the stored one every ``FOLLOW_SECONDS`` and takes it up when it
changed (one small read; a catalog changes rarely and a few seconds' lag is harmless, so no
channel of its own)."""

from __future__ import annotations

import asyncio
import logging

from darkbloom.wire.catalog import Catalog
from darkbloom.coordinator.services import Services
from darkbloom.store import stored_settings

_NAME = "catalog"
FOLLOW_SECONDS = 2.0
log = logging.getLogger("darkbloom.catalog")


async def load_catalog(services: Services) -> None:
    if services.settings.catalog_from_file:
        await store_catalog(services, services.settings.catalog)
        return
    async with services.engine.connect() as conn:
        stored = await stored_settings.get(conn, _NAME)
    if stored is not None:
        services.settings.catalog = Catalog.model_validate(stored)


async def store_catalog(services: Services, catalog: Catalog) -> None:
    async with services.engine.begin() as conn:
        await stored_settings.put(conn, _NAME, catalog.model_dump())
    _use(services, catalog)


def _use(services: Services, catalog: Catalog) -> None:
    services.settings.catalog = catalog
    services.registry.close_views()  # what they admit may differ now (a weight_hash pin, aliases)


async def follow_catalog(services: Services, interval: float = FOLLOW_SECONDS) -> None:
    """Take up a catalog another replica stored (a shared Postgres database; a SQLite file has one
    coordinator, whose own PUT already applied it). A read during which this replica took up a catalog
    of its own (a PUT) is dropped: it may have begun before that catalog was stored, and would put
    the old one back until the next read."""
    if services.engine.dialect.name != "postgresql":
        return
    while True:
        await asyncio.sleep(interval)
        in_force = services.settings.catalog
        try:
            async with services.engine.connect() as conn:
                stored = await stored_settings.get(conn, _NAME)
        except Exception as exc:  # noqa: BLE001 - the database is away: keep the catalog in force, retry
            log.warning("cannot read the stored catalog: %s", exc)
            continue
        if services.settings.catalog is not in_force:
            continue
        if stored is not None and stored != in_force.model_dump():
            _use(services, Catalog.model_validate(stored))
            log.info("took up the catalog another replica stored (%d models)", len(services.settings.catalog.models))
