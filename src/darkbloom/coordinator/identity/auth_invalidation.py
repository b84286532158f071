"""How a change to what a token grants reaches every coordinator's ``AuthCache``.

On this process: ``changing()`` is the transaction that revokes, deletes, edits or logs out; when
it ends it drops this process's grants itself, so the very next request here reads the database
whatever the state of any channel.

Between processes: Postgres ``LISTEN/NOTIFY`` on channel ``darkbloom_auth`` (``store.notices``),
whenever the database is Postgres (with or without ``--redis-url``): the notice commits with the
change. Redis pub/sub would only serve processes sharing a SQLite file, which is not a supported
deployment (SQLite is the one-process embedded default: the local drop is all).

When the channel is down (``store.notices``): until the listener is listening, and from the moment
it is lost (closed, or a ping failed), the cache is suspended: it stores nothing and every request
asks the database, as before the cache existed. Once it listens again the cache resumes empty,
since notices may have been missed. A failure nobody notices (or an operator's UPDATE in psql) is
bounded by the cache's max age (``auth_cache.MAX_AGE``).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from prometheus_client import Gauge
from sqlalchemy.ext.asyncio import AsyncConnection

from darkbloom.coordinator.services import Services
from darkbloom.store.notices import Listener, Subscription, notify

CHANNEL = "darkbloom_auth"

LISTENING = Gauge("darkbloom_auth_invalidation_listening",
                  "1 while this coordinator receives other processes' auth changes (Postgres LISTEN)")


@contextlib.asynccontextmanager
async def changing(services: Services, *subjects: str) -> AsyncIterator[AsyncConnection]:
    """A transaction that changes what the tokens of ``subjects`` grant: it announces them to the
    other coordinators (committed with it) and drops them from this process's cache when it ends."""
    try:
        async with services.engine.begin() as conn:
            yield conn
            if subjects:
                await notify(conn, CHANNEL, " ".join(subjects))
    finally:
        services.auth_cache.invalidate(subjects)  # also after a rollback: nothing changed, no harm


def subscribe(services: Services, listener: Listener) -> None:
    """Other coordinators' changes drop grants here; the cache is suspended until the listener listens,
    so no request is served from memory before LISTEN is in place."""
    cache = services.auth_cache
    cache.suspend()

    def listening(up: bool) -> None:
        LISTENING.set(1 if up else 0)
        if up:
            cache.resume()
        else:
            cache.suspend()

    listener.subscribe(Subscription(CHANNEL, lambda payload: cache.invalidate(payload.split()), listening))
