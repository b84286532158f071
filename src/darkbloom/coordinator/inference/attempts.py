"""Getting a request to its first content: sequential retry and the speculative backup.

Before anything reaches the client, a provider that errors, disconnects or stays silent for the
first-content budget is excluded and the next eligible session is tried (at most 3 attempts;
retries never queue). When the primary has produced nothing by half the budget and another
eligible session is idle, one backup starts; the first to produce content wins and the other is
cancelled. Every attempt uses the request's one ``RouteDecision``.

A request that takes its provider's session down with it (the node disconnected before any output,
as a node the request crashed does) may be a poison request: after that it goes to one more session
at most (no backup either), and when a second session goes down it fails as
``request_crashed_providers`` instead of walking the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from prometheus_client import Counter

from darkbloom.coordinator.inference.attempt import Attempt
from darkbloom.coordinator.inference.calls import InferenceCall
from darkbloom.coordinator.inference.failures import ProviderFailure, crashed_providers, timed_out
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.scheduler import Claim, claim, load_seconds, select_idle_or_free

log = logging.getLogger("darkbloom.attempts")
MAX_ATTEMPTS = 3
SESSIONS_A_REQUEST_MAY_TAKE_DOWN = 2
CRASHED_PROVIDERS = Counter("darkbloom_requests_crashed_providers_total",
                            "Requests failed because their attempts took down two provider sessions before any output")


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
        self.taken_down = 0  # sessions that went away with this request before any output
        self.sent_since_takedown: int | None = None  # attempts sent after (or still live at) the first

    def _dispatch(self, claimed: Claim) -> Attempt:
        attempt = Attempt(self.request_id, claimed.slot, self.life.usage_bounds, self.call.api)
        attempt.dispatch(self.call, claimed.provider_model_id, self.max_tokens)
        self.life.track(attempt)
        if self.sent_since_takedown is not None:
            self.sent_since_takedown += 1
        return attempt

    def _drop(self, attempt: Attempt) -> None:
        attempt.abandon()
        self.decision.excluded.add(attempt.session.id)

    def _failed(self, attempt: Attempt, still_live: int = 0) -> None:
        """Drop a failed attempt, counting its session when the request took it down."""
        if attempt.sent and not attempt.session.online:
            self.taken_down += 1
            if self.sent_since_takedown is None:
                self.sent_since_takedown = still_live  # a backup racing it already is the one more session
        self._drop(attempt)

    @property
    def _may_send_more(self) -> bool:
        return self.sent_since_takedown is None or self.sent_since_takedown == 0

    async def run(self, first: Claim) -> tuple[Attempt, bool]:
        """The winning attempt (also recorded on the lifecycle) and whether it already completed;
        raises the last ProviderFailure."""
        claimed: Claim | None = first
        failure: ProviderFailure | None = None
        for number in range(1, MAX_ATTEMPTS + 1):
            assert claimed is not None
            primary = self._dispatch(claimed)
            try:
                winner, completed = await self._first_content(primary)
                self.life.serve_with(winner)
                return winner, completed
            except ProviderFailure as exc:
                failure = exc
                log.info("request %s: attempt %d on %s failed: %s", self.request_id, number,
                         claimed.session.id, exc.failure.reason)
                if not retryable(exc):
                    raise
            if self.taken_down >= SESSIONS_A_REQUEST_MAY_TAKE_DOWN:
                CRASHED_PROVIDERS.inc()
                log.warning("request %s took down %d provider sessions before any output: not tried again",
                            self.request_id, self.taken_down)
                raise crashed_providers()
            if number == MAX_ATTEMPTS or not self._may_send_more:
                break  # claiming another slot now would leak it: nothing would ever dispatch or release it
            claimed = self._idle_or_free(require_idle=False)
            if claimed is None:
                break
        assert failure is not None
        raise failure

    def _idle_or_free(self, *, require_idle: bool, owned_only: bool = False) -> Claim | None:
        decision = dataclasses.replace(self.decision, owned_only=True) if owned_only else self.decision
        session = select_idle_or_free(self.services.registry, decision, self.services.settings, require_idle)
        if session is None:
            return None
        claimed = claim(self.services.registry, session, decision)
        self.life.hold(claimed.slot)
        return claimed

    def _clock_starts(self, attempt: Attempt) -> float:
        """When the attempt's first-content budget starts: now, or once its node has loaded the model
        when it does not have it in memory (the scheduler's estimate of the load)."""
        return time.monotonic() + load_seconds(attempt.session, self.decision)

    async def _first_content(self, primary: Attempt) -> tuple[Attempt, bool]:
        budget = self.services.settings.first_content_timeout
        started = self._clock_starts(primary)
        try:
            return primary, await primary.first_content(started + budget / 2)
        except ProviderFailure:
            self._failed(primary)
            raise
        except TimeoutError:
            pass
        # a prefer request served by an owned session never gets a paid backup
        owned_primary = self.decision.owns(primary.session)
        claimed = (self._idle_or_free(require_idle=True, owned_only=owned_primary)
                   if self.sent_since_takedown is None else None)
        if claimed is None:
            try:
                return primary, await primary.first_content(started + budget)
            except TimeoutError:
                self._drop(primary)
                raise timed_out(budget) from None
            except ProviderFailure:
                self._failed(primary)
                raise
        backup = self._dispatch(claimed)
        log.info("request %s: %s silent after %.1f s, backup on %s", self.request_id, primary.session.id,
                 budget / 2, backup.session.id)
        return await self._race(primary, backup, {primary: started + budget,
                                                  backup: self._clock_starts(backup) + budget})

    async def _race(self, primary: Attempt, backup: Attempt,
                    deadlines: dict[Attempt, float]) -> tuple[Attempt, bool]:
        tasks = {asyncio.ensure_future(a.first_content(deadlines[a])): a for a in (primary, backup)}
        failure: ProviderFailure | None = None
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    attempt = tasks.pop(task)
                    try:
                        completed = task.result()
                    except (ProviderFailure, TimeoutError) as exc:
                        failure = exc if isinstance(exc, ProviderFailure) else timed_out(
                            self.services.settings.first_content_timeout)
                        self._failed(attempt, still_live=len(tasks))
                        continue
                    for other_task, other in tasks.items():
                        other_task.cancel()
                        self._drop(other)
                    return attempt, completed
        finally:
            for task in tasks:
                task.cancel()
        assert failure is not None
        raise failure
