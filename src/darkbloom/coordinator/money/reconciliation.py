"""Coordinator instances: each process heartbeats a row; reservations left open by an instance
that stopped heartbeating (a crash) are refunded, at start and then periodically — and so are this
instance's own reservations older than the longest any request can take (a settlement that kept
failing must not hold money until the next restart)."""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import insert, select, update

from darkbloom.coordinator.money.billing import refund_request
from darkbloom.coordinator.services import Services
from darkbloom.store import ledger
from darkbloom.store.schema import coordinator_instances

log = logging.getLogger("darkbloom.instances")


async def register_instance(services: Services) -> None:
    now = int(time.time())
    async with services.engine.begin() as conn:
        await conn.execute(insert(coordinator_instances).values(id=services.instance_id, started_at=now,
                                                                last_seen=now))


# beyond the deadlines: settlement retries with backoff, and clocks that disagree by a little
_SETTLE_MARGIN = 60.0


def longest_request(services: Services) -> float:
    """Seconds from a reservation to the end of its request, at the most: the queue, the request
    deadline, the cancelled provider's grace, and a margin for settlement retries."""
    settings = services.settings
    return settings.queue_max_wait + settings.request_timeout + settings.cancel_grace + _SETTLE_MARGIN


async def reconcile_abandoned(services: Services) -> int:
    """Refund open reservations whose instance is not this one and has not been seen lately, or that
    are this instance's own and older than any request can run, through the ledger writer (one batch
    for all of them; a reservation another replica closes first is skipped)."""
    now = time.time()
    stale_before = int(now - services.settings.instance_stale_after)
    own_before = int(now - longest_request(services))
    async with services.engine.connect() as conn:
        live = [row[0] for row in await conn.execute(
            select(coordinator_instances.c.id).where(coordinator_instances.c.last_seen >= stale_before))]
        live.append(services.instance_id)
        abandoned = [r for r in await ledger.open_reservations(conn) if r["instance_id"] not in live
                     or (r["instance_id"] == services.instance_id and int(r["created_at"]) < own_before)]
    done = await asyncio.gather(*(refund_request(services, r["request_id"]) for r in abandoned))
    for reservation, refunded in zip(abandoned, done):
        if refunded:
            log.warning("reconciled reservation %s (%d µUSD) left open by instance %s: refunded",
                        reservation["request_id"], reservation["amount_micro_usd"], reservation["instance_id"])
    return sum(done)


async def heartbeat_forever(services: Services) -> None:
    interval = max(1.0, services.settings.instance_stale_after / 3)
    while True:
        await asyncio.sleep(interval)
        try:
            async with services.engine.begin() as conn:
                await conn.execute(update(coordinator_instances)
                                   .where(coordinator_instances.c.id == services.instance_id)
                                   .values(last_seen=int(time.time())))
            await reconcile_abandoned(services)
        except Exception:  # noqa: BLE001 - keep heartbeating through transient database errors
            log.exception("instance heartbeat failed")
