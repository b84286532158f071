"""The long-lived parts of a running coordinator, shared by every route."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Coroutine, Protocol, TypeVar

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.consumer_key import CoordinatorKey
from darkbloom.coordinator.identity.auth_cache import AuthCache
from darkbloom.coordinator.routing.affinity import Affinity
from darkbloom.coordinator.routing.queue import RequestQueues
from darkbloom.coordinator.money.ratelimit import RateLimiter
from darkbloom.coordinator.money.ledger.writer import LedgerWriter
from darkbloom.coordinator.fleet.device_owners import DeviceOwners
from darkbloom.coordinator.fleet.insight import MachineInsight
from darkbloom.coordinator.fleet.machine_book import MachineBook
from darkbloom.coordinator.fleet.registration_gate import RegistrationGate
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.wire.crypto import new_id

T = TypeVar("T")


class ReplicaFabric(Protocol):
    """What the process asks of ``fabric.replica.Fabric`` (which is built on these services)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, object]: ...


@dataclass
class Services:
    settings: CoordinatorSettings
    engine: AsyncEngine
    registry: Registry
    rate_limiter: RateLimiter
    consumer_key: CoordinatorKey | None = None  # loaded at start (GET /v1/encryption-key)
    instance_id: str = field(default_factory=lambda: new_id("inst_"))
    auth_cache: AuthCache = field(default_factory=AuthCache)  # token hash → grant (identity/auth_cache.py)
    fabric: ReplicaFabric | None = None  # with --nats-url (replicas over NATS); None: one process
    registrations: RegistrationGate = field(default_factory=RegistrationGate)  # provider sockets registering
    affinity: Affinity = field(default_factory=Affinity)  # conversations → the session that served them, here
    requests_in_flight: int = 0  # inference requests taken up and not yet ended (inference/settlement.py)
    queues: RequestQueues = field(init=False)            # per-model queues over the registry
    ledger: LedgerWriter = field(init=False)             # the group-commit ledger writer, on engine
    machine_book: MachineBook = field(init=False)        # batched machines-table writes, on engine
    device_owners: DeviceOwners = field(init=False)      # registrations' token owners, batched, on engine
    insight: MachineInsight = field(init=False)          # machine insight, sampled and written in batches
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.queues = RequestQueues(self.registry, self.settings)
        self.ledger = LedgerWriter(self.engine, quiet=lambda: self.requests_in_flight <= 1)
        self.machine_book = MachineBook(self.engine, self.settings.machine_flush_interval)
        self.device_owners = DeviceOwners(self.engine)
        self.insight = MachineInsight(self.registry, self.engine, self.settings.insight_interval)

    def spawn(self, work: Coroutine[object, None, T]) -> asyncio.Task[T]:
        """Run ``work`` to completion even if the request that started it goes away."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


async def get_services(request: Request) -> Services:  # async: FastAPI runs sync dependencies in a thread
    services: Services = request.app.state.services
    return services
