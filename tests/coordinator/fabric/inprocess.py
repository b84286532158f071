"""Replicas in one process over an in-memory NATS: the real ``Fabric`` of each (its connection's
sealing and writer, the advertiser, the view, the holder), with a fake client in place of nats-py
that hands every message to the other replicas' subscriptions and keeps it for the test to count.

The bus refuses what a NATS server with its ``max_payload`` would, and remembers having been asked:
``Bus.oversize`` must stay empty. ``Bus.lose`` drops chosen messages on their way (NATS core is
at-most-once). ``settle`` turns the loop until nothing moves (waiting out a view owed to a replica
that asked again within the heartbeat, which is short here).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from nats.errors import MaxPayloadError

from darkbloom.coordinator.fabric.authentication import Peer
from darkbloom.coordinator.fabric.replica import Fabric
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.services import Services
from tests.coordinator.routing.sim import SimProvider, services, settings

SMALL = 4096  # the tests' max_payload: it holds four or five announcements


@dataclass
class Sent:
    sender: str
    subject: str
    data: bytes

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.data.partition(b"\n")[2])

    @property
    def kind(self) -> str:
        return str(self.body.get("k"))


@dataclass
class FakeMsg:
    subject: str
    data: bytes
    reply: str = ""


class FakeClient:
    """What ``Connection`` uses of a nats-py client."""

    def __init__(self, bus: "Bus", replica: str) -> None:
        self.bus = bus
        self.replica = replica
        self.is_connected = True
        self.is_closed = False

    @property
    def max_payload(self) -> int:
        return self.bus.max_payload

    async def publish(self, subject: str, data: bytes) -> None:
        self.bus.publish(self, subject, data)

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> None:
        self.bus.subscriptions.append((self, subject, cb))

    async def flush(self, timeout: float = 1) -> None:
        pass

    async def close(self) -> None:
        self.is_closed = True


def _matches(pattern: str, subject: str) -> bool:
    want, got = pattern.split("."), subject.split(".")
    return len(want) == len(got) and all(w in ("*", g) for w, g in zip(want, got))


@dataclass
class Bus:
    max_payload: int = 1024 * 1024
    sent: list[Sent] = field(default_factory=list)
    oversize: list[Sent] = field(default_factory=list)
    subscriptions: list[tuple[FakeClient, str, Callable[[Any], Awaitable[None]]]] = field(default_factory=list)
    lose: Callable[[Sent], bool] = lambda _sent: False
    replicas: list["Replica"] = field(default_factory=list)
    _deliveries: list["asyncio.Task[None]"] = field(default_factory=list)

    def publish(self, client: FakeClient, subject: str, data: bytes) -> None:
        sent = Sent(client.replica, subject, data)
        if len(data) > self.max_payload:
            self.oversize.append(sent)
            raise MaxPayloadError
        self.sent.append(sent)
        if self.lose(sent):
            return
        for subscriber, pattern, cb in list(self.subscriptions):
            if subscriber is not client and not subscriber.is_closed and _matches(pattern, subject):
                self._deliveries.append(asyncio.ensure_future(cb(FakeMsg(subject, data))))

    def since(self, mark: int, sender: str | None = None) -> list[Sent]:
        return [s for s in self.sent[mark:] if sender is None or s.sender == sender]

    async def settle(self, owed: bool = True) -> None:
        """Turn the loop until no replica has changes, messages or deliveries pending (nor, if
        ``owed``, views it owes a replica that asked again within the heartbeat)."""
        wait_for_owed = owed
        quiet = 0
        for _ in range(10_000):
            for replica in self.replicas:
                if replica.fabric.advertiser._flush_at is not None:
                    replica.fabric.advertiser.flush()
            owed = wait_for_owed and any(r.fabric.advertiser._answer_later for r in self.replicas)
            await asyncio.sleep(0.002 if owed else 0)
            busy = (owed or any(not r.fabric.connection._outgoing.empty() for r in self.replicas)
                    or any(not task.done() for task in self._deliveries))
            self._deliveries = [task for task in self._deliveries if not task.done()]
            quiet = 0 if busy else quiet + 1
            if quiet > 3:
                return
        raise AssertionError("the replicas never settled")


@dataclass
class Replica:
    bus: Bus
    fabric: Fabric
    services: Services
    writer: "asyncio.Task[None] | None" = None

    @property
    def id(self) -> str:
        return self.fabric.subjects.replica

    @property
    def registry(self) -> Registry:
        return self.services.registry

    def add(self, count: int = 1, **options: Any) -> list[SimProvider]:
        """``count`` sessions connected here (listed: their chunks prove their node)."""
        sims = []
        for _ in range(count):
            sim = SimProvider(**options)
            sim.session.registration = sim.session.registration.model_copy(update={"authenticated_chunks": True})
            self.registry.add(sim.session)
            sims.append(sim)
        return sims

    async def join(self) -> None:
        """Connect to the bus: subscribe, start the writer, and come up (ask everyone, say alive)."""
        connection = self.fabric.connection
        client = FakeClient(self.bus, self.id)
        await self.fabric._subscribe(client)  # type: ignore[arg-type]
        connection.client = client  # type: ignore[assignment]
        self.writer = asyncio.ensure_future(connection._write_forever())
        connection._up()

    def stand_ins_of(self, other: "Replica") -> set[str]:
        return {sid for sid, link in self.fabric.view.links.items() if link.holder == other.id}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.cancel()
        for handle in self.fabric.advertiser._answer_later.values():
            handle.cancel()


def make_replica(bus: Bus, heartbeat: float = 0.01, url: str = "nats://in-memory", **fields: Any) -> Replica:
    """A replica on ``bus`` that knows every replica made before it (and they it), not joined yet
    (with a real ``url``, its connection may instead join that NATS server)."""
    config = settings(nats_url=url, replica_heartbeat=heartbeat,
                      replica_timeout=max(3.0, 3 * heartbeat), **fields)
    svc = services(Registry(), config)
    fabric = Fabric(svc)
    replica = Replica(bus, fabric, svc)
    for other in bus.replicas:
        _introduce(replica, other)
        _introduce(other, replica)
    bus.replicas.append(replica)
    return replica


def _introduce(to: Replica, whom: Replica) -> None:
    """``to`` knows ``whom``'s key (as it would from the database)."""
    key = whom.fabric.roster.key.signing_key.verify_key
    to.fabric.roster.peers[whom.id] = Peer(whom.id, key, to.fabric.roster.key.pair_key(key))
