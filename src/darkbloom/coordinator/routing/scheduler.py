"""Choosing a provider session: named gates in a fixed order, then the lowest expected wait.

A ``RouteDecision`` is made once per request and carried through first dispatch, sequential
retries, the speculative backup and the queue, so all four honour the same rules (which
sessions may be used, what is relaxed for the owner, which sessions already failed).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from prometheus_client import Counter

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.gates import NO_FREE_SLOT, first_failed_gate

log = logging.getLogger("darkbloom.scheduler")
REJECTIONS = Counter("darkbloom_scheduler_rejections_total", "Sessions a gate turned away", ["reason"])


@dataclass(frozen=True)
class Placement:
    """A claimed slot on a session that can serve the request, and the model id it knows it by."""

    slot: Slot
    provider_model_id: str
    owned: bool

    @property
    def session(self) -> ProviderSession:
        return self.slot.session


@dataclass
class Survey:
    """What the gates found: who could serve at all, who can serve now, and why others cannot."""

    eligible: list[ProviderSession] = field(default_factory=list)
    available: list[ProviderSession] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


def candidates(registry: Registry, decision: RouteDecision) -> Iterable[ProviderSession]:
    """Owner-restricted requests look only at the owner's sessions: O(their machines), not O(fleet)."""
    if decision.owned_only and decision.owner_account_id:
        pool: Iterable[ProviderSession] = registry.owned_by(decision.owner_account_id)
    else:
        pool = registry.serving(decision.names)
        if decision.owner_account_id:
            pool = set(pool) | registry.owned_by(decision.owner_account_id)
    if decision.pinned:
        pool = [s for s in pool if decision.pinned in (s.id, s.machine_id)]
    return pool


def survey(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
           now: float | None = None) -> Survey:
    now = time.monotonic() if now is None else now
    result = Survey()
    for session in candidates(registry, decision):
        if session.id in decision.excluded:
            continue
        reason = first_failed_gate(session, decision, settings, now)
        if reason is None:
            result.eligible.append(session)
            if session.has_free_slot:
                result.available.append(session)
            else:
                reason = NO_FREE_SLOT
        if reason is not None:
            result.reasons[reason] = result.reasons.get(reason, 0) + 1
            REJECTIONS.labels(reason).inc()
            log.debug("session %s rejected for %s: %s", session.id, decision.model.id, reason)
    return result


def expected_wait(session: ProviderSession) -> tuple[float, float]:
    """Rank for time to first content: load over capacity first, then the faster measured decode
    speed (a session not yet measured ranks as the slowest among equally loaded ones)."""
    return (session.active + 1) / session.max_concurrency, -session.decode_tps


def choose(available: list[ProviderSession], decision: RouteDecision) -> Optional[ProviderSession]:
    """Owned sessions first whenever one is available (prefer and exclusive), then the rest."""
    owned = [s for s in available if decision.owns(s)]
    pool = owned or ([] if decision.owned_only else [s for s in available if not decision.owns(s)])
    if not pool:
        return None
    best = min(expected_wait(s) for s in pool)
    return random.choice([s for s in pool if expected_wait(s) == best])


def claim(registry: Registry, session: ProviderSession, decision: RouteDecision) -> Placement:
    provider_model_id = next(name for name in decision.names if name in session.advertised_models)
    return Placement(registry.slots.claim(session), provider_model_id, owned=decision.owns(session))


def try_place(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
              found: Survey | None = None) -> Placement | None:
    found = found or survey(registry, decision, settings)
    session = choose(found.available, decision)
    return claim(registry, session, decision) if session is not None else None


def routable_public(registry: Registry, model: CatalogModel, settings: CoordinatorSettings) -> bool:
    """Whether at least one public session could serve the model (for /v1/models)."""
    decision = RouteDecision(model=model)
    now = time.monotonic()
    return any(first_failed_gate(s, decision, settings, now) is None for s in registry.serving(decision.names))
