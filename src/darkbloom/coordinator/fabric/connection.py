"""This replica's NATS connection: connect (and keep retrying while the server is unreachable),
subscribe, say whether it is up, and send through one writer task so that the many small messages
of a stream leave in order without a task each.

nats-py reconnects by itself once a first connection was made, and restores the subscriptions; a
first connection that fails is retried here, 0.5 s doubling to 5 s. While there is no connection,
messages are dropped: the replicas on the other side stop hearing this one and, after
``--replica-timeout``, treat it as gone, which is what it is to them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from prometheus_client import Gauge

log = logging.getLogger("darkbloom.fabric")

CONNECTED = Gauge("darkbloom_nats_connected", "1 while this replica is connected to NATS (--nats-url)")
RETRY_FIRST = 0.5
RETRY_MAX = 5.0
PING_INTERVAL = 2  # seconds; two unanswered pings and the connection is lost
_QUEUE_LIMIT = 100_000  # messages waiting for the writer; beyond it the fabric is behind and drops

Subscriber = Callable[[Client], Awaitable[None]]


class Connection:
    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.client: Client | None = None
        self._outgoing: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(_QUEUE_LIMIT)
        self._on_up: list[Callable[[], None]] = []
        self._closing = False
        CONNECTED.set(0)

    @property
    def connected(self) -> bool:
        return self.client is not None and self.client.is_connected

    @property
    def max_payload(self) -> int:
        return self.client.max_payload if self.client is not None else 1024 * 1024

    def on_up(self, callback: Callable[[], None]) -> None:
        """Called on the first connection and on every reconnection (e.g. to announce everything)."""
        self._on_up.append(callback)

    async def run(self, subscribe: Subscriber) -> None:
        """Connect (retrying), subscribe, then send whatever is posted, for as long as the replica runs."""
        delay = RETRY_FIRST
        while self.client is None:
            try:
                client = await nats.connect(
                    self.url, name=self.name, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=1, connect_timeout=2, ping_interval=PING_INTERVAL, max_outstanding_pings=2,
                    disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
                    error_cb=self._error, closed_cb=self._closed)
            except Exception as exc:  # noqa: BLE001 - unreachable: keep serving our own sessions, retry
                if delay == RETRY_FIRST:
                    log.warning("NATS at %s unreachable (%s); serving this replica's own sessions until it is up",
                                self.url, exc or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            try:
                await subscribe(client)
            except Exception:  # noqa: BLE001 - lost as it came up: start over
                log.exception("NATS subscriptions failed; reconnecting")
                await client.close()
                await asyncio.sleep(delay)
                continue
            self.client = client
            log.info("connected to NATS at %s", self.url)
            self._up()
        await self._write_forever()

    def post(self, subject: str, data: bytes) -> None:
        """Queue a message for the writer (never blocks); dropped while there is no connection."""
        if self.client is None or self.client.is_closed:
            return
        try:
            self._outgoing.put_nowait((subject, data))
        except asyncio.QueueFull:
            log.warning("NATS writer is %d messages behind: dropping", _QUEUE_LIMIT)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes | None:
        """A reply, or None when nobody answers in time (or there is no connection)."""
        client = self.client
        if client is None or not client.is_connected:
            return None
        try:
            reply = await client.request(subject, data, timeout=timeout)
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError):
            return None
        except Exception:  # noqa: BLE001 - a connection problem is no answer
            log.debug("NATS request on %s failed", subject, exc_info=True)
            return None
        return reply.data

    async def _write_forever(self) -> None:
        queue = self._outgoing
        while True:
            subject, data = await queue.get()
            client = self.client
            if client is None:
                continue
            try:
                await client.publish(subject, data)
            except Exception:  # noqa: BLE001 - reconnecting or closed: the message is lost, as NATS core may
                log.debug("NATS publish on %s failed", subject, exc_info=True)

    async def close(self) -> None:
        self._closing = True
        client, self.client = self.client, None
        if client is not None and not client.is_closed:
            try:
                await asyncio.wait_for(client.flush(timeout=1), 2)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            await client.close()
        CONNECTED.set(0)

    def _up(self) -> None:
        CONNECTED.set(1)
        for callback in self._on_up:
            callback()

    async def _disconnected(self) -> None:
        CONNECTED.set(0)
        if not self._closing:
            log.warning("NATS connection lost; serving this replica's own sessions until it is back")

    async def _reconnected(self) -> None:
        log.info("reconnected to NATS at %s", self.url)
        self._up()

    async def _error(self, exc: Exception) -> None:
        log.debug("NATS: %s", exc)

    async def _closed(self) -> None:
        CONNECTED.set(0)

    async def flush_pending(self) -> None:
        """Send what is queued now (at shutdown)."""
        client = self.client
        while client is not None and not self._outgoing.empty():
            subject, data = self._outgoing.get_nowait()
            try:
                await client.publish(subject, data)
            except Exception:  # noqa: BLE001
                return


