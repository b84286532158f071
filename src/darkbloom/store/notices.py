"""Changes one coordinator announces to the others sharing its Postgres database: ``LISTEN/NOTIFY``.

``notify`` is sent inside the transaction that makes the change, so Postgres delivers it if and only
if the change commits, at the commit, to every process sharing the database: no window in which the
change is committed and its notice lost (as with a publish after the commit, when the process dies in
between), and no second system whose outage must be handled apart. On SQLite (one embedded
coordinator) it does nothing: the process that made the change applies it itself.

Each coordinator keeps one dedicated asyncpg connection, the ``Listener``, that LISTENs on every
channel a part of the coordinator subscribed to and is pinged every ``PING_INTERVAL``. Notices
missed while it was not listening are lost, so each subscriber is told when listening starts (again)
and when it stops, and catches up or falls back on its own terms. The listener reconnects (0.5 s,
doubling to 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger("darkbloom.notices")

APPLICATION_NAME = "darkbloom notice listener"  # how the listening connection shows in pg_stat_activity
# A silently broken connection (the only kind a closed socket does not report at once) is found
# within this: subscribers bound what they keep meanwhile by their own rules (the auth cache's max age)
PING_INTERVAL = 5.0
PING_TIMEOUT = 3.0
RECONNECT_FIRST = 0.5
RECONNECT_MAX = 5.0
_SQLALCHEMY_ONLY = ("prepared_statement_cache_size", "prepared_statement_name_func", "async_creator_fn")


async def notify(conn: AsyncConnection, channel: str, payload: str = "") -> None:
    """Announce ``payload`` on ``channel`` when ``conn``'s transaction commits (Postgres; a no-op on SQLite)."""
    if conn.dialect.name == "postgresql":
        await conn.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})


@dataclass(frozen=True)
class Subscription:
    channel: str
    on_notice: Callable[[str], None]                  # the payload of each notice, in commit order
    on_listening: Callable[[bool], None] = lambda _up: None  # True: listening (again); False: lost


class Listener:
    def __init__(self, engine: AsyncEngine, *, ping_interval: float = PING_INTERVAL,
                 ping_timeout: float = PING_TIMEOUT, reconnect_first: float = RECONNECT_FIRST,
                 reconnect_max: float = RECONNECT_MAX) -> None:
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.reconnect_first = reconnect_first
        self.reconnect_max = reconnect_max
        self.subscriptions: list[Subscription] = []
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        self._connect_args: tuple[Any, ...] = tuple(args)
        self._connect_kwargs = {k: v for k, v in kwargs.items() if k not in _SQLALCHEMY_ONLY}
        self._connect_kwargs["server_settings"] = {**(kwargs.get("server_settings") or {}),
                                                   "application_name": APPLICATION_NAME}
        self.listening = False
        self.sessions = 0  # how many times LISTEN was established

    def subscribe(self, subscription: Subscription) -> None:
        """Before ``run``: what a part of the coordinator listens to."""
        self.subscriptions.append(subscription)

    async def run(self) -> None:
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
                log.warning("notice listener (%s): %s; retrying in %.1f s",
                            ", ".join(s.channel for s in self.subscriptions),
                            " ".join(str(exc).split()) or type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_max)

    async def _listen_once(self) -> None:
        import asyncpg

        lost = asyncio.Event()
        conn = await asyncpg.connect(*self._connect_args, **self._connect_kwargs, timeout=10)
        try:
            conn.add_termination_listener(lambda _conn: lost.set())
            for subscription in self.subscriptions:
                await conn.add_listener(subscription.channel, _deliver(subscription))
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
        if up:
            self.sessions += 1
            log.info("listening for other coordinators' changes on %s",
                     ", ".join(s.channel for s in self.subscriptions))
        for subscription in self.subscriptions:
            try:
                subscription.on_listening(up)
            except Exception:  # noqa: BLE001 - one subscriber's failure is not the others'
                log.exception("notice subscriber of %s failed", subscription.channel)


def _deliver(subscription: Subscription) -> Callable[[object, int, str, str], None]:
    def deliver(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            subscription.on_notice(payload)
        except Exception:  # noqa: BLE001 - a bad notice must not stop the listener
            log.exception("notice on %s failed", subscription.channel)
    return deliver
