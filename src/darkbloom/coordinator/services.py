"""The long-lived parts of a running coordinator, shared by every route."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Coroutine

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.config import CoordinatorSettings
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


@dataclass
class Services:
    settings: CoordinatorSettings
    engine: AsyncEngine
    registry: Registry
    rate_limiter: RateLimiter
    queues: RequestQueues = None  # type: ignore[assignment]  # built from registry + settings
    consumer_key: Any = None  # sealed_body.CoordinatorKey, loaded at start (GET /v1/encryption-key)
    instance_id: str = field(default_factory=lambda: new_id("inst_"))
    auth_cache: AuthCache = field(default_factory=AuthCache)  # token hash → grant (identity/auth_cache.py)
    ledger: LedgerWriter = None  # type: ignore[assignment]  # the group-commit ledger writer, on engine
    machine_book: MachineBook = None  # type: ignore[assignment]  # batched machines-table writes, on engine
    fabric: Any = None  # fabric.replica.Fabric with --nats-url (replicas over NATS); None: one process
    registrations: RegistrationGate = field(default_factory=RegistrationGate)  # provider sockets registering
    device_owners: DeviceOwners = None  # type: ignore[assignment]  # registrations' token owners, batched, on engine
    insight: MachineInsight = None  # type: ignore[assignment]  # machine insight, sampled and written in batches
    affinity: Affinity = field(default_factory=Affinity)  # conversations → the session that served them, here
    requests_in_flight: int = 0  # inference requests taken up and not yet ended (inference/settlement.py)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.queues is None:
            self.queues = RequestQueues(self.registry, self.settings)
        if self.ledger is None:
            self.ledger = LedgerWriter(self.engine, quiet=lambda: self.requests_in_flight <= 1)
        if self.machine_book is None:
            self.machine_book = MachineBook(self.engine, self.settings.machine_flush_interval)
        if self.device_owners is None:
            self.device_owners = DeviceOwners(self.engine)
        if self.insight is None:
            self.insight = MachineInsight(self.registry, self.engine, self.settings.insight_interval)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
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
