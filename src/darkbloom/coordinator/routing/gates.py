"""The scheduler's gates: named checks in a fixed order, each a reason in logs, metrics and the
Self-Route errors (docs/routing.md "The gates, in order")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.trust import challenge_fresh, trust_at_least
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.wire.protocol import CAPABILITIES, ModelInfo


Check = Callable[[ProviderSession, RouteDecision, CoordinatorSettings, float], bool]


def _serves_model(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return any(name in s.advertised_models for name in d.names)


def _verified_weights(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    # an owner may run any weights for themselves; anyone else needs an entry with the pinned ones
    return d.owns(s) or any(d.model.verifies(m.weight_hash) for m in s.registration.models if m.id in d.names)


def _trusted(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.online and s.untrusted_reason is None and not s.draining


def _private_only(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return not s.private_only or d.may_use(s)  # the owner, or someone the owner shared it with


def _trust_floor(s: ProviderSession, d: RouteDecision, c: CoordinatorSettings, _n: float) -> bool:
    return d.may_use(s) or trust_at_least(s.trust_level, c.min_trust)


def _runtime_verified(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.runtime_verified


def _encrypted_chunks(s: ProviderSession, _d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    return s.registration.encrypted_response_chunks and s.public_key is not None


def _challenge_fresh(s: ProviderSession, _d: RouteDecision, c: CoordinatorSettings, now: float) -> bool:
    return challenge_fresh(s, c, now)


def _capabilities(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    if not d.needs:
        return True
    return any(d.needs <= model_capabilities(m) for m in s.registration.models if m.id in d.names)


def _context_fits(s: ProviderSession, d: RouteDecision, _c: CoordinatorSettings, _n: float) -> bool:
    if not d.context_needed:
        return True
    context = s.context_for(d.names)
    return context == 0 or d.context_needed <= context


def model_capabilities(model: ModelInfo) -> frozenset[str]:
    """What a registered model advertises, `images` included when it is a vision model."""
    advertised = frozenset(model.capabilities) & CAPABILITIES
    return advertised | {"images"} if model.is_vision else advertised


@dataclass(frozen=True)
class Gate:
    """A named check; ``blocker`` is what an owner is told when only this gate keeps their own
    machine from serving them privately (the privacy gates and ``untrusted``). A ``lasting`` gate's
    answer changes only when the session, the settings or the request's model, owner or needs do,
    never with the clock or the request's size, so the registry's views can keep it
    (``passes_lasting_gates``)."""

    name: str
    check: Check
    blocker: str | None = None
    lasting: bool = True


# The fixed order; the names are the reasons in logs, metrics and self-route errors.
GATES: tuple[Gate, ...] = (
    Gate("model_not_served", _serves_model),
    Gate("unverified_weights", _verified_weights),
    Gate("untrusted", _trusted,
         blocker="it failed an integrity check (restart the node; if it persists, reinstall it)"),
    Gate("private_only", _private_only),
    Gate("trust_below_floor", _trust_floor),
    Gate("runtime_not_verified", _runtime_verified,
         blocker="its Darkbloom runtime is not a verified release (update the node to this release)"),
    Gate("no_encrypted_chunks", _encrypted_chunks, blocker="it cannot encrypt its responses (update the node)"),
    Gate("challenge_stale", _challenge_fresh,
         blocker="it has not passed a recent attestation challenge (restart the node)", lasting=False),
    Gate("capability_unsupported", _capabilities),
    Gate("context_length", _context_fits, lasting=False),
)
PRIVACY_GATES = frozenset({"runtime_not_verified", "no_encrypted_chunks", "challenge_stale"})
LASTING_GATES = tuple(gate for gate in GATES if gate.lasting)
NO_FREE_SLOT = "no_free_slot"
CONTEXT_GATE = "context_length"  # the last gate: a session failing it passed all the others


def first_failed_gate(session: ProviderSession, decision: RouteDecision, settings: CoordinatorSettings,
                      now: float) -> Optional[str]:
    for gate in GATES:
        if not gate.check(session, decision, settings, now):
            return gate.name
    return None


def first_failed_lasting_gate(session: ProviderSession, decision: RouteDecision,
                              settings: CoordinatorSettings) -> Optional[str]:
    for gate in LASTING_GATES:
        if not gate.check(session, decision, settings, 0.0):
            return gate.name
    return None


def passes_lasting_gates(session: ProviderSession, decision: RouteDecision, settings: CoordinatorSettings) -> bool:
    for gate in LASTING_GATES:
        if not gate.check(session, decision, settings, 0.0):
            return False
    return True
