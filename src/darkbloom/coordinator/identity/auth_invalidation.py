"""How a change to what a token grants reaches every coordinator's ``AuthCache``.

On this process: ``changing()`` is the transaction that revokes, deletes, edits or logs out; when
it ends it drops this process's grants itself, so the very next request here reads the database
whatever the state of any channel.

Between processes: Postgres ``LISTEN/NOTIFY`` on channel ``darkbloom_auth``, whenever the database
is Postgres (with or without ``--redis-url``). The notice is sent inside the transaction that makes
the change, so Postgres delivers it if and only if the change commits, at the commit, to every
coordinator sharing the database: there is no window in which the change is committed and its
notice lost (as with a Redis PUBLISH after the commit, when the process dies in between), no
second system whose outage must be handled apart, and every process that shares the database is
connected to it already. Redis pub/sub would only serve processes sharing a SQLite file, which is
not a supported deployment (SQLite is the one-process embedded default: the local drop is all).

When the channel is down: each coordinator keeps one dedicated asyncpg connection that LISTENs and
is pinged every second. Until it is listening, and from the moment it is lost (closed, or a ping
failed), the cache is suspended: it stores nothing and every request asks the database, as before
the cache existed. The listener reconnects (0.5 s, doubling to 5 s) and the cache resumes empty,
since notices may have been missed. A failure nobody notices (or an operator's UPDATE in psql) is
bounded by the cache's max age (``auth_cache.MAX_AGE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from prometheus_client import Gauge
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from darkbloom.coordinator.identity.auth_cache import AuthCache
from darkbloom.coordinator.services import Services

log = logging.getLogger("darkbloom.auth")

CHANNEL = "darkbloom_auth"
APPLICATION_NAME = "darkbloom auth listener"  # how the listening connection shows in pg_stat_activity
PING_INTERVAL = 1.0
PING_TIMEOUT = 3.0
RECONNECT_FIRST = 0.5
RECONNECT_MAX = 5.0
_SQLALCHEMY_ONLY = ("prepared_statement_cache_size", "prepared_statement_name_func", "async_creator_fn")

LISTENING = Gauge("darkbloom_auth_invalidation_listening",
                  "1 while this coordinator receives other processes' auth changes (Postgres LISTEN)")


@contextlib.asynccontextmanager
async def changing(services: Services, *subjects: str) -> AsyncIterator[AsyncConnection]:
    """A transaction that changes what the tokens of ``subjects`` grant: it announces them to the
    other coordinators (committed with it) and drops them from this process's cache when it ends."""
    try:
        async with services.engine.begin() as conn:
            yield conn
            await notify(conn, subjects)
    finally:
        services.auth_cache.invalidate(subjects)  # also after a rollback: nothing changed, no harm


async def notify(conn: AsyncConnection, subjects: tuple[str, ...] | list[str]) -> None:
    """Announce ``subjects`` when ``conn``'s transaction commits (Postgres; a no-op on SQLite)."""
    if subjects and conn.dialect.name == "postgresql":
        await conn.execute(text("SELECT pg_notify(:channel, :payload)"),
                           {"channel": CHANNEL, "payload": " ".join(subjects)})


def start(services: Services) -> asyncio.Task[None]:
    """The listener task of this coordinator (on Postgres; it ends at once on SQLite). The cache is
    suspended before this returns, so no request is served from memory before LISTEN is in place."""
    engine = services.engine
    if engine.dialect.name != "postgresql":
        return asyncio.get_running_loop().create_task(asyncio.sleep(0))
    services.auth_cache.suspend()
    return asyncio.get_running_loop().create_task(Listener(engine, services.auth_cache).run())


class Listener:
    def __init__(self, engine: AsyncEngine, cache: AuthCache, *, ping_interval: float = PING_INTERVAL,
                 ping_timeout: float = PING_TIMEOUT, reconnect_first: float = RECONNECT_FIRST,
                 reconnect_max: float = RECONNECT_MAX) -> None:
        self.cache = cache
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.reconnect_first = reconnect_first
        self.reconnect_max = reconnect_max
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        self._connect_args: tuple[Any, ...] = tuple(args)
        self._connect_kwargs = {k: v for k, v in kwargs.items() if k not in _SQLALCHEMY_ONLY}
        self._connect_kwargs["server_settings"] = {**(kwargs.get("server_settings") or {}),
                                                   "application_name": APPLICATION_NAME}
        self.listening = False
        self.sessions = 0  # how many times LISTEN was established

    async def run(self) -> None:
        self.cache.suspend()
        delay = self.reconnect_first
        while True:
            sessions = self.sessions
            try:
                await self._listen_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means: reconnect
                if self.sessions != sessions:
                    delay = self.reconnect_first  # it was listening: a new outage starts the back-off over
                log.warning("auth change listener: %s; tokens are read from the database until it is back "
                            "(retrying in %.1f s)", " ".join(str(exc).split()) or type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_max)

    async def _listen_once(self) -> None:
        import asyncpg

        lost = asyncio.Event()
        conn = await asyncpg.connect(*self._connect_args, **self._connect_kwargs, timeout=10)
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(CHANNEL, self._on_notice)
            self._set_listening(True)
            while not lost.is_set() and not conn.is_closed():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lost.wait(), self.ping_interval)
                    break
                await asyncio.wait_for(conn.fetchval("SELECT 1"), self.ping_timeout)
            raise ConnectionError("the listening connection was closed")
        finally:
            self._set_listening(False)
            conn.terminate()

    def _set_listening(self, up: bool) -> None:
        if up == self.listening:
            return
        self.listening = up
        LISTENING.set(1 if up else 0)
        if up:
            self.sessions += 1
            self.cache.resume()
            log.info("auth change listener is listening on %s", CHANNEL)
        else:
            self.cache.suspend()

    def _on_notice(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self.cache.invalidate(payload.split())
