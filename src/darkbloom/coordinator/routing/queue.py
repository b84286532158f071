"""Per-model queues for requests whose eligible sessions are all busy (docs/routing.md "Fail fast, or queue").

A waiter keeps its own ``RouteDecision``; each drain re-evaluates every waiter in arrival order
with its own rules, and a waiter that cannot be placed keeps its place. Drains run whenever a
slot is released (the queues listen on the registry's slots) and, while anything waits, on a short
tick, which also covers new registrations, heartbeats and trust changes.

Batch lines (``decision.batch``) wait in queues of their own: a drain places them only after every
live waiter of their model, so a batch line takes a slot only when no live request is waiting for
it, and they never count towards a queue's depth.

Placing and draining select from the registry's views (``scheduler.select``); the full survey runs
only when a refusal's ``survey`` is read (the Self-Route pre-flight reads it, over the owner's sessions),
so a request for a model nothing can serve costs the same whatever the size of the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.scheduler import Claim, Survey, any_eligible, survey, try_place
from darkbloom.coordinator.routing.decision import RouteDecision

log = logging.getLogger("darkbloom.queue")
DRAIN_TICK = 0.25


class NoEligibleSession(Exception):
    """Nothing could serve this request at all: fail at once, never wait."""

    def __init__(self, surveyed: Callable[[], Survey]) -> None:
        super().__init__("no eligible session")
        self._surveyed = surveyed
        self._survey: Survey | None = None

    @property
    def survey(self) -> Survey:
        """Every candidate through every gate, with the reasons; surveyed when first read."""
        if self._survey is None:
            self._survey = self._surveyed()
        return self._survey


class QueueRefused(Exception):
    def __init__(self, code: str, retry_after: int, surveyed: Callable[[], Survey] | None = None) -> None:
        super().__init__(code)
        self.code = code  # queue_full | queue_timeout
        self.retry_after = retry_after
        self._surveyed = surveyed
        self._survey: Survey | None = None

    @property
    def survey(self) -> Survey | None:
        """What the gates say about the request, surveyed when first read (the request path never does)."""
        if self._survey is None and self._surveyed is not None:
            self._survey = self._surveyed()
        return self._survey


@dataclass(eq=False)
class _Waiter:
    decision: RouteDecision
    future: asyncio.Future[Claim]
    enqueued_at: float = field(default_factory=time.monotonic)


class RequestQueues:
    def __init__(self, registry: Registry, settings: CoordinatorSettings) -> None:
        self.registry = registry
        self.settings = settings
        self._queues: dict[str, deque[_Waiter]] = {}
        self._batch_queues: dict[str, deque[_Waiter]] = {}  # batch lines, behind every live waiter of their model
        self._recent_wait: dict[str, float] = {}
        self._draining = False
        self._someone_waits = asyncio.Event()
        registry.slots.on_release(self.drain)

    def depth(self, model_id: str) -> int:
        return len(self._queues.get(model_id, ()))

    async def place(self, decision: RouteDecision) -> Claim:
        """A claimed slot now, or after waiting in the model's queue; raises NoEligibleSession or QueueRefused."""
        model_id = decision.model.id
        queues = self._batch_queues if decision.batch else self._queues
        if not self._queues.get(model_id) and not queues.get(model_id):
            placement = try_place(self.registry, decision, self.settings)
            if placement is not None:
                return placement
        if not any_eligible(self.registry, decision, self.settings):
            raise NoEligibleSession(self._surveyor(decision))
        queue = queues.setdefault(model_id, deque())
        if not decision.batch and len(queue) >= self.settings.queue_depth:
            raise QueueRefused("queue_full", self._retry_after(model_id), self._surveyor(decision))
        waiter = _Waiter(decision, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        self._someone_waits.set()
        self.drain()
        try:
            # not wait_for: on Python 3.11 it swallows a cancel that races with the placement and
            # returns the claimed slot to a caller that has gone away (the slot would leak)
            await asyncio.wait({waiter.future}, timeout=self.settings.queue_max_wait)
        except asyncio.CancelledError:
            self._leave(queues, model_id, waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().slot.release()  # placed as we left: give it to the next waiter
            waiter.future.cancel()
            raise
        if not waiter.future.done():
            self._leave(queues, model_id, waiter)
            waiter.future.cancel()
            raise QueueRefused("queue_timeout", self._retry_after(model_id), self._surveyor(decision))
        if not decision.batch:
            self._recent_wait[model_id] = time.monotonic() - waiter.enqueued_at
        return waiter.future.result()

    def drain(self) -> None:
        if self._draining or not (self._queues or self._batch_queues):
            return  # re-entered (or nothing waits): the running drain sees every waiter
        self._draining = True
        try:
            self._drain(self._queues)
            if self._batch_queues:
                self._drain(self._batch_queues, after=self._queues)
        finally:
            self._draining = False

    def _drain(self, queues: dict[str, deque[_Waiter]], after: dict[str, deque[_Waiter]] | None = None) -> None:
        """Each waiter of ``queues`` in arrival order; none of a model that still has waiters in ``after``."""
        for model_id, queue in list(queues.items()):
            if after is not None and after.get(model_id):
                continue
            for waiter in list(queue):
                if waiter.future.done():
                    self._leave(queues, model_id, waiter)
                    continue
                placement = try_place(self.registry, waiter.decision, self.settings)
                if placement is not None:
                    self._leave(queues, model_id, waiter)
                    waiter.future.set_result(placement)
            if not queue:
                queues.pop(model_id, None)

    async def drain_forever(self) -> None:
        while True:
            if not (self._queues or self._batch_queues):
                self._someone_waits.clear()
                await self._someone_waits.wait()
            await asyncio.sleep(DRAIN_TICK)
            self.drain()

    @staticmethod
    def _leave(queues: dict[str, deque[_Waiter]], model_id: str, waiter: _Waiter) -> None:
        queue = queues.get(model_id)
        if queue is not None and waiter in queue:
            queue.remove(waiter)

    def _surveyor(self, decision: RouteDecision) -> Callable[[], Survey]:
        return lambda: survey(self.registry, decision, self.settings)

    def _retry_after(self, model_id: str) -> int:
        """Seconds until a retry likely finds a slot: the most recent time a waiter needed to be placed."""
        return max(1, math.ceil(self._recent_wait.get(model_id, 1.0)))

