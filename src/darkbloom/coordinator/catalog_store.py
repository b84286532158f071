"""The live catalog: the --catalog file when given, else the last one stored by the admin API,
else the built-in default. PUT /v1/admin/catalog stores it so restarts and replicas agree."""

from __future__ import annotations

from sqlalchemy import select

from darkbloom.catalog import Catalog
from darkbloom.coordinator.services import Services
from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import stored_settings

_NAME = "catalog"


async def load_catalog(services: Services) -> None:
    if services.settings.catalog_from_file:
        await store_catalog(services, services.settings.catalog)
        return
    async with services.engine.connect() as conn:
        row = (await conn.execute(select(stored_settings.c.value).where(stored_settings.c.name == _NAME))).first()
    if row is not None:
        services.settings.catalog = Catalog.model_validate(row[0])


async def store_catalog(services: Services, catalog: Catalog) -> None:
    value = catalog.model_dump()
    async with services.engine.begin() as conn:
        if not await insert_ignore(conn, stored_settings, name=_NAME, value=value):
            await conn.execute(stored_settings.update().where(stored_settings.c.name == _NAME).values(value=value))
    services.settings.catalog = catalog
