"""Choosing a provider session for a request.

For now: among online sessions serving the model, the least loaded one with a free slot.
The named gates, the per-model queue, retry and backup build on this (see docs/routing.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from darkbloom.catalog import CatalogModel
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.registry import ProviderSession, Registry


@dataclass(frozen=True)
class Placement:
    session: ProviderSession
    provider_model_id: str


def model_names(model: CatalogModel) -> tuple[str, ...]:
    return (model.id, *model.aliases)


def public_sessions(registry: Registry, model: CatalogModel) -> set[ProviderSession]:
    return {s for s in registry.serving(model_names(model)) if not s.private_only}


def select(registry: Registry, model: CatalogModel) -> Placement:
    candidates = public_sessions(registry, model)
    if not candidates:
        raise ApiError(503, "model_unavailable",
                       f"No provider is serving '{model.id}' right now. Try again later or pick another model.")
    free = [s for s in candidates if s.has_free_slot]
    if not free:
        raise ApiError(429, "rate_limit_exceeded",
                       f"Every provider serving '{model.id}' is busy. Retry shortly.",
                       headers={"Retry-After": "1"})
    lowest = min(s.active / s.max_concurrency for s in free)
    session = random.choice([s for s in free if s.active / s.max_concurrency == lowest])
    names = model_names(model)
    provider_model_id = next(name for name in names if name in session.advertised_models)
    return Placement(session, provider_model_id)
