"""The live catalog: the --catalog file when given, else the last one stored by the admin API,
else the built-in default. PUT /v1/admin/catalog stores it so restarts and replicas agree."""

from __future__ import annotations

from darkbloom.wire.catalog import Catalog
from darkbloom.coordinator.services import Services
from darkbloom.store import stored_settings

_NAME = "catalog"


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
    services.settings.catalog = catalog
    services.registry.close_views()  # what they admit may differ now (a weight_hash pin, aliases)
