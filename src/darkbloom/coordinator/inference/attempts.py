"""Getting a request to its first content: sequential retry and the speculative backup.

Before anything reaches the client, a provider that errors, disconnects or stays silent for the
first-content budget is excluded and the next eligible session is tried (at most 3 attempts;
retries never queue). When the primary has produced nothing by half the budget and another
eligible session is idle, one backup starts; the first to produce content wins and the other is
cancelled. Every attempt uses the request's one ``RouteDecision``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from darkbloom.coordinator.fleet.pending import PendingRequest
from darkbloom.coordinator.inference import relay
from darkbloom.coordinator.inference.calls import InferenceCall
from darkbloom.coordinator.inference.lifecycle import RequestLifecycle
from darkbloom.coordinator.inference.relay import ProviderFailure
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.scheduler import Placement, claim, select_idle_or_free

log = logging.getLogger("darkbloom.attempts")
MAX_ATTEMPTS = 3


def retryable(failure: ProviderFailure) -> bool:
    """A failure caused by the request itself fails that request only; any other may be retried."""
    return not failure.request_fault


class Attempts:
    """Every slot it claims and every attempt it dispatches belongs to the request's lifecycle,
    which releases whatever is still held when the request ends, however it ends."""

    def __init__(self, life: RequestLifecycle, decision: RouteDecision, call: InferenceCall,
                 max_tokens: int) -> None:
        self.life = life
        self.services = life.services
        self.decision = decision
        self.call = call
        self.request_id = life.request_id
        self.max_tokens = max_tokens

    def _dispatch(self, placement: Placement) -> PendingRequest:
        pending = relay.dispatch(placement.slot, self.call, placement.provider_model_id, self.request_id,
                                 self.max_tokens, self.life.usage_bounds)
        self.life.track(pending)
        return pending

    def _drop(self, pending: PendingRequest) -> None:
        relay.abandon(pending)
        self.decision.excluded.add(pending.session.id)

    async def run(self, first: Placement) -> tuple[PendingRequest, bool]:
        """The winning attempt (also recorded on the lifecycle) and whether it already completed;
        raises the last ProviderFailure."""
        placement: Placement | None = first
        failure: ProviderFailure | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            assert placement is not None
            primary = self._dispatch(placement)
            try:
                winner, completed = await self._first_content(primary)
                self.life.serve_with(winner)
                return winner, completed
            except ProviderFailure as exc:
                failure = exc
                log.info("request %s: attempt %d on %s failed: %s", self.request_id, attempt,
                         placement.session.id, exc.failure.reason)
                if not retryable(exc):
                    raise
            if attempt == MAX_ATTEMPTS:
                break  # claiming another slot now would leak it: nothing would ever dispatch or release it
            placement = self._idle_or_free(require_idle=False)
            if placement is None:
                break
        assert failure is not None
        raise failure

    def _idle_or_free(self, *, require_idle: bool, owned_only: bool = False) -> Placement | None:
        decision = dataclasses.replace(self.decision, owned_only=True) if owned_only else self.decision
        session = select_idle_or_free(self.services.registry, decision, self.services.settings, require_idle)
        if session is None:
            return None
        placement = claim(self.services.registry, session, decision)
        self.life.hold(placement.slot)
        return placement

    async def _first_content(self, primary: PendingRequest) -> tuple[PendingRequest, bool]:
        budget = self.services.settings.first_content_timeout
        started = time.monotonic()
        try:
            return primary, await relay.first_content(primary, started + budget / 2)
        except ProviderFailure:
            self._drop(primary)
            raise
        except TimeoutError:
            pass
        # a prefer request served by an owned session never gets a paid backup
        owned_primary = self.decision.owns(primary.session)
        placement = self._idle_or_free(require_idle=True, owned_only=owned_primary)
        if placement is None:
            try:
                return primary, await relay.first_content(primary, started + budget)
            except TimeoutError:
                self._drop(primary)
                raise relay.timed_out(budget) from None
            except ProviderFailure:
                self._drop(primary)
                raise
        backup = self._dispatch(placement)
        log.info("request %s: %s silent after %.1f s, backup on %s", self.request_id, primary.session.id,
                 budget / 2, backup.session.id)
        return await self._race(primary, backup, {primary: started + budget,
                                                  backup: time.monotonic() + budget})

    async def _race(self, primary: PendingRequest, backup: PendingRequest,
                    deadlines: dict[PendingRequest, float]) -> tuple[PendingRequest, bool]:
        tasks = {asyncio.ensure_future(relay.first_content(p, deadlines[p])): p for p in (primary, backup)}
        failure: ProviderFailure | None = None
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    pending = tasks.pop(task)
                    try:
                        completed = task.result()
                    except (ProviderFailure, TimeoutError) as exc:
                        failure = exc if isinstance(exc, ProviderFailure) else relay.timed_out(
                            self.services.settings.first_content_timeout)
                        self._drop(pending)
                        continue
                    for other_task, other in tasks.items():
                        other_task.cancel()
                        self._drop(other)
                    return pending, completed
        finally:
            for task in tasks:
                task.cancel()
        assert failure is not None
        raise failure
