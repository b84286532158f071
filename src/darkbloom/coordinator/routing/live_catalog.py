"""The live catalog: the --catalog file when given, else the last one stored by the admin API,
else the built-in default. PUT /v1/admin/catalog stores it so restarts and replicas agree: on a
shared (Postgres) database the store announces itself (``store.notices``), and every other replica
reads the stored catalog when told, and whenever its listener starts listening (again), since a
notice may have been missed meanwhile."""

from __future__ import annotations

import asyncio
import logging

from darkbloom.wire.catalog import Catalog
from darkbloom.coordinator.services import Services
from darkbloom.store import notices, stored_settings

_NAME = "catalog"
CHANNEL = "darkbloom_catalog"
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
        await notices.notify(conn, CHANNEL)
    _use(services, catalog)


def _use(services: Services, catalog: Catalog) -> None:
    services.settings.catalog = catalog
    services.registry.close_views()  # what they admit may differ now (a weight_hash pin, aliases)


def subscribe(services: Services, listener: notices.Listener) -> None:
    """Take up a catalog another replica stored, when it says so (a SQLite file has one coordinator,
    whose own PUT already applied it)."""
    follower = _Follower(services)
    listener.subscribe(notices.Subscription(CHANNEL, lambda _payload: follower.read(),
                                            lambda up: follower.read() if up else None))


class _Follower:
    """One read at a time; a notice during a read asks for one more after it."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._reading: asyncio.Task[None] | None = None
        self._again = False

    def read(self) -> None:
        if self._reading is not None and not self._reading.done():
            self._again = True
            return
        self._reading = asyncio.get_running_loop().create_task(self._read_until_current())

    async def _read_until_current(self) -> None:
        self._again = True
        while self._again:
            self._again = False
            await follow_once(self.services)


async def follow_once(services: Services) -> None:
    """Read the stored catalog and take it up when it differs. A read during which this replica took
    up a catalog of its own (a PUT) is dropped: it may have begun before that catalog was stored, and
    would put the old one back (that PUT's own notice brings a read after it)."""
    in_force = services.settings.catalog
    try:
        async with services.engine.connect() as conn:
            stored = await stored_settings.get(conn, _NAME)
    except Exception as exc:  # noqa: BLE001 - the database is away: keep the catalog in force (when it is
        # back the listener, which lost it too, listens again and that reads it)
        log.warning("cannot read the stored catalog: %s", exc)
        return
    if services.settings.catalog is not in_force:
        return
    if stored is not None and stored != in_force.model_dump():
        _use(services, Catalog.model_validate(stored))
        log.info("took up the catalog another replica stored (%d models)", len(services.settings.catalog.models))
