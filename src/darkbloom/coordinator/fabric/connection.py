"""This replica's NATS connection: connect (and keep retrying while the server is unreachable),
subscribe, say whether it is up, and send through one writer task so that the many small messages
of a stream leave in order without a task each.

nats-py reconnects by itself once a first connection was made, and restores the subscriptions; a
first connection that fails is retried here, 0.5 s doubling to 5 s. While there is no connection,
messages are dropped: the replicas on the other side stop hearing this one and, after
``--replica-timeout``, treat it as gone, which is what it is to them.

No message leaves bigger than the server's ``max_payload`` (the callers split what may be big at
``room``; anything still too big is refused here). A message that cannot be sent — too big, no
connection, the writer too far behind, the server refusing it — is counted in
``darkbloom_fabric_publish_failed_total{reason}`` and said in an error line (at most one a
``FAILURE_LOG_EVERY`` per reason, with the count since the last), never dropped silently.

A request (a claim) waits on an inbox of this replica's for the first reply that proves it comes
from the replica asked: anyone who hears the request can answer on its inbox too, and what proves
nothing is dropped and counted, never taken for the answer (nats-py's own ``request`` would take the
first message, whoever sent it). All of this replica's inboxes are one subscription.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import AuthorizationError
from prometheus_client import Counter, Gauge

from darkbloom.coordinator.fabric.authentication import EVERYONE, MAX_LINE, Authenticator, Opened, Rejected, refuse
from darkbloom.coordinator.fabric.nats_auth import redacted

log = logging.getLogger("darkbloom.fabric")

CONNECTED = Gauge("darkbloom_nats_connected", "1 while this replica is connected to NATS (--nats-url)")
PUBLISH_FAILED = Counter("darkbloom_fabric_publish_failed_total",
                         "Fabric messages this replica could not send", ["reason"])
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # NATS's default, until the server says its own
PROOF_ROOM = MAX_LINE + 1  # the proof line and its newline, in front of every body
FAILURE_LOG_EVERY = 10.0  # seconds between error lines of one kind of failed publish
RETRY_FIRST = 0.5
RETRY_MAX = 5.0
PING_INTERVAL = 2  # seconds; two unanswered pings and the connection is lost
REFUSAL_EVERY = 60.0  # seconds between warnings that the server refuses our credentials
_QUEUE_LIMIT = 100_000  # messages waiting for the writer; beyond it the fabric is behind and drops

Subscriber = Callable[[Client], Awaitable[None]]


class Connection:
    def __init__(self, url: str, name: str, authenticator: Authenticator,
                 options: dict[str, Any] | None = None) -> None:
        self.url = redacted(url)  # what the logs show; nats.connect gets _servers
        self._servers = url
        self.options = dict(options or {})
        self.name = name
        self.authenticator = authenticator
        self._refusal_said_at = float("-inf")
        self.client: Client | None = None
        self._outgoing: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(_QUEUE_LIMIT)
        self._on_up: list[Callable[[], None]] = []
        self._closing = False
        self._failures: dict[str, tuple[float, int]] = {}  # reason → (when last said, failures since)
        self._inbox = ""  # this replica's inboxes are <it>.<token>, one subscription
        self._tokens = itertools.count()
        self._asked: dict[str, tuple[str, asyncio.Future[Opened]]] = {}  # token → the replica asked, its answer
        CONNECTED.set(0)

    @property
    def connected(self) -> bool:
        return self.client is not None and self.client.is_connected

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (its ``max_payload``), proof line included."""
        return self.client.max_payload if self.client is not None else DEFAULT_MAX_PAYLOAD

    @property
    def room(self) -> int:
        """The largest body a message may carry behind its proof line."""
        return self.max_payload - PROOF_ROOM

    def on_up(self, callback: Callable[[], None]) -> None:
        """Called on the first connection and on every reconnection (e.g. to ask for the others' views)."""
        self._on_up.append(callback)

    async def run(self, subscribe: Subscriber) -> None:
        """Connect (retrying), subscribe, then send whatever is posted, for as long as the replica runs."""
        delay = RETRY_FIRST
        while self.client is None:
            try:
                client = await nats.connect(
                    self._servers, name=self.name, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=1, connect_timeout=2, ping_interval=PING_INTERVAL, max_outstanding_pings=2,
                    disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
                    error_cb=self._error, closed_cb=self._closed, no_echo=True, **self.options)
            except Exception as exc:  # noqa: BLE001 - unreachable: keep serving our own sessions, retry
                if delay == RETRY_FIRST:
                    log.warning("NATS at %s unreachable (%s); serving this replica's own sessions until it is up",
                                self.url, exc or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            try:
                await subscribe(client)
                self._inbox = client.new_inbox()
                await client.subscribe(self._inbox + ".*", cb=self._on_reply)
            except Exception:  # noqa: BLE001 - lost as it came up: start over
                log.exception("NATS subscriptions failed; reconnecting")
                await client.close()
                await asyncio.sleep(delay)
                continue
            self.client = client
            log.info("connected to NATS at %s", self.url)
            self._up()
        await self._write_forever()

    def post(self, subject: str, data: bytes, to: str = EVERYONE) -> bool:
        """Queue a message for the writer, sealed for ``to`` (never blocks). False, counted and logged,
        when it cannot go: no connection, no key for ``to`` yet, bigger than ``max_payload``, or the
        writer too far behind."""
        client = self.client
        if client is None or not client.is_connected:
            return self.failed("disconnected", subject)
        sealed = self.authenticator.seal(subject, data, to)
        if sealed is None:
            return self.failed("unknown_replica", subject, f"no key for replica {to} yet")
        if len(sealed) > client.max_payload:
            return self.failed("too_big", subject, f"{len(sealed)} bytes, the server takes {client.max_payload}")
        try:
            self._outgoing.put_nowait((subject, sealed))
        except asyncio.QueueFull:
            return self.failed("queue_full", subject, f"the writer is {_QUEUE_LIMIT} messages behind")
        return True

    def failed(self, reason: str, subject: str, detail: str = "") -> bool:
        """A message that did not leave: counted, and an error line at most every ``FAILURE_LOG_EVERY``."""
        PUBLISH_FAILED.labels(reason).inc()
        if self._closing:
            return False  # this replica stops: its goodbye went out, what was left behind is moot
        said_at, since = self._failures.get(reason, (float("-inf"), 0))
        now = time.monotonic()
        if now - said_at < FAILURE_LOG_EVERY:
            self._failures[reason] = (said_at, since + 1)
            return False
        self._failures[reason] = (now, 0)
        more = f" ({since} more since the last such line)" if since else ""
        log.error("NATS: a message on %s was not sent: %s%s%s", subject, reason.replace("_", " "),
                  f" ({detail})" if detail else "", more)
        return False

    async def request(self, subject: str, data: bytes, to: str, timeout: float) -> Opened | None:
        """The first reply that proves it comes from ``to``, or None when none does in time (or there is
        no connection). Replies that prove nothing are dropped and counted on the way."""
        client = self.client
        sealed = self.authenticator.seal(subject, data, to)
        if client is None or not client.is_connected or sealed is None or not self._inbox:
            return None
        token = str(next(self._tokens))
        answer: asyncio.Future[Opened] = asyncio.get_running_loop().create_future()
        self._asked[token] = (to, answer)
        try:
            await client.publish(subject, sealed, reply=f"{self._inbox}.{token}")
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - a connection problem is no answer
            log.debug("NATS request on %s failed", subject, exc_info=True)
            return None
        finally:
            del self._asked[token]

    async def _on_reply(self, msg: Msg) -> None:
        asked = self._asked.get(msg.subject.rpartition(".")[2])
        if asked is None or asked[1].done():
            return  # its request has its answer, or gave up: nothing is waiting for this one
        opened = await self.open(msg)
        to, answer = asked
        if opened is None or answer.done():
            return
        if opened.sender != to:
            refuse("impersonation", "replica %s answered a request to replica %s", opened.sender, to)
            return
        answer.set_result(opened)

    async def open(self, msg: Msg) -> Opened | None:
        """A received message's sender and body, or None (dropped and counted) when it proves nothing."""
        try:
            return await self.authenticator.open(msg.subject, msg.data)
        except Rejected as rejected:
            log.debug("dropped a message on %s: %s", msg.subject, rejected.reason)
            return None

    def reply(self, msg: Msg, data: bytes, to: str) -> None:
        """Answer a request ``to`` sent (on its reply subject, sealed for it)."""
        if msg.reply:
            self.post(msg.reply, data, to)

    async def _write_forever(self) -> None:
        queue = self._outgoing
        while True:
            subject, data = await queue.get()
            client = self.client
            if client is None:
                continue
            try:
                await client.publish(subject, data)
            except Exception as exc:  # noqa: BLE001 - reconnecting or closed: the message is lost, as NATS core may
                self.failed("nats_error", subject, str(exc) or type(exc).__name__)

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
        """Refused credentials or certificates are the operator's to fix: said once a minute, not buried."""
        text = str(exc) or type(exc).__name__
        refused = isinstance(exc, (ssl.SSLError, AuthorizationError)) or "authoriz" in text.lower()
        now = time.monotonic()
        if refused and now - self._refusal_said_at >= REFUSAL_EVERY:
            self._refusal_said_at = now
            log.warning("NATS at %s refuses this replica (%s): check --nats-creds/--nats-nkey/--nats-tls-*",
                        self.url, redacted(text))
        else:
            log.debug("NATS: %s", redacted(text))

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


