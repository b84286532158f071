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
from typing import Callable, Iterable, Optional

from prometheus_client import Counter

from darkbloom.catalog import CatalogModel
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.registry import ProviderSession, Registry
from darkbloom.coordinator.trust import challenge_fresh, trust_at_least

log = logging.getLogger("darkbloom.scheduler")
REJECTIONS = Counter("darkbloom_scheduler_rejections_total", "Sessions a gate turned away", ["reason"])


@dataclass
class RouteDecision:
    model: CatalogModel
    needs_images: bool = False
    needs_tools: bool = False
    owner_account_id: str | None = None   # self-route: the caller's account, whose sessions are "owned"
    owned_only: bool = False              # exclusive self-route: never the public fleet
    pinned: str | None = None             # an owned mach_… or prov_… id (exclusive only)
    excluded: set[str] = field(default_factory=set)  # sessions that already failed this request

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model.id, *self.model.aliases)

    def owns(self, session: ProviderSession) -> bool:
        return self.owner_account_id is not None and session.account_id == self.owner_account_id


@dataclass(frozen=True)
class Placement:
    """A claimed slot: ``session.active`` already counts this request."""

    session: ProviderSession
    provider_model_id: str
    owned: bool


@dataclass
class Survey:
    """What the gates found: who could serve at all, who can serve now, and why others cannot."""

    eligible: list[ProviderSession] = field(default_factory=list)
    available: list[ProviderSession] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


Gate = Callable[[ProviderSession, RouteDecision, CoordinatorSettings, float], bool]


def _serves_model(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    if not any(name in s.advertised_models for name in d.names):
        return False
    pinned_hash = d.model.weight_hash
    if pinned_hash:
        hashes = {m.weight_hash for m in s.registration.models if m.id in d.names}
        return pinned_hash in hashes
    return True


def _trusted(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.online and s.untrusted_reason is None and not s.draining


def _private_only(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return not s.private_only or d.owns(s)


def _trust_floor(s: ProviderSession, d: RouteDecision, c: CoordinatorSettings, _n: float) -> bool:
    return d.owns(s) or trust_at_least(s.trust_level, c.min_trust)


def _runtime_verified(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.runtime_verified


def _encrypted_chunks(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.registration.encrypted_response_chunks and s.public_key is not None


def _challenge_fresh(s: ProviderSession, _d: RouteDecision, c: CoordinatorSettings, now: float) -> bool:
    return challenge_fresh(s, c, now)


def _capabilities(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    if d.needs_images:
        return any(m.is_vision for m in s.registration.models if m.id in d.names)
    return True


# The fixed order; the names are the reasons in logs, metrics and self-route errors.
GATES: tuple[tuple[str, Gate], ...] = (
    ("model_not_served", _serves_model),
    ("untrusted", _trusted),
    ("private_only", _private_only),
    ("trust_below_floor", _trust_floor),
    ("runtime_not_verified", _runtime_verified),
    ("no_encrypted_chunks", _encrypted_chunks),
    ("challenge_stale", _challenge_fresh),
    ("capability_unsupported", _capabilities),
)
PRIVACY_GATES = frozenset({"runtime_not_verified", "no_encrypted_chunks", "challenge_stale"})


def first_failed_gate(session: ProviderSession, decision: RouteDecision, settings: CoordinatorSettings,
                      now: float) -> Optional[str]:
    for reason, gate in GATES:
        if not gate(session, decision, settings, now):
            return reason
    return None


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
                reason = "no_free_slot"
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


def claim(session: ProviderSession, decision: RouteDecision) -> Placement:
    session.active += 1
    provider_model_id = next(name for name in decision.names if name in session.advertised_models)
    return Placement(session, provider_model_id, owned=decision.owns(session))


def try_place(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
              found: Survey | None = None) -> Placement | None:
    found = found or survey(registry, decision, settings)
    session = choose(found.available, decision)
    return claim(session, decision) if session is not None else None


def routable_public(registry: Registry, model: CatalogModel, settings: CoordinatorSettings) -> bool:
    """Whether at least one public session could serve the model (for /v1/models)."""
    decision = RouteDecision(model=model)
    now = time.monotonic()
    return any(first_failed_gate(s, decision, settings, now) is None for s in registry.serving(decision.names))
