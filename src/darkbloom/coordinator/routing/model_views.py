"""What GET /v1/models shows: the public catalog with at least one routable public provider, or,
under an exclusive self-route policy, the caller's owned-model view (with shared routing, and the
models of the machines shared with the caller)."""

from __future__ import annotations

import time
from typing import Any

from darkbloom.wire.catalog import MAX_MODEL_ID, CatalogModel
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.routing.scheduler import routable_public
from darkbloom.coordinator.routing.decision import Policy, RouteDecision, ShareGrant
from darkbloom.coordinator.routing.gates import first_failed_gate
from darkbloom.coordinator.services import Services

CREATED = 1735689600  # a fixed date: catalog entries carry no creation time


def _entry(model_id: str, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": CREATED, "owned_by": owned_by}


def _allowed(caller: Caller) -> frozenset[str] | None:
    return caller.key.allowed_models if caller.key else None


def owned_models(services: Services, account_id: str, shares: tuple[ShareGrant, ...] = ()) -> dict[str, str]:
    """Model id → owned_by for what the account's own online sessions can serve it now:
    catalog models under their catalog id, others (reachable only by the owner) as "self"; with
    ``shares``, also what the machines they cover can serve the account (others' models as "shared")."""
    catalog = services.settings.catalog
    found: dict[str, str] = {}
    now = time.monotonic()
    sessions = [(s, "self") for s in services.registry.owned_by(account_id)]
    for owner in dict.fromkeys(grant.owner_account_id for grant in shares):
        sessions += [(s, "shared") for s in services.registry.owned_by(owner)]
    for session, whose in sessions:
        for advertised in session.advertised_models:
            if len(advertised) > MAX_MODEL_ID:
                continue  # nobody can ask for it; never a model entry
            model = catalog.resolve(advertised) or CatalogModel(id=advertised, input_price=0, output_price=0)
            decision = RouteDecision(model=model, owner_account_id=account_id, owned_only=True, shares=shares)
            if decision.may_use(session) and first_failed_gate(session, decision, services.settings, now) is None:
                found.setdefault(model.id, "darkbloom" if catalog.resolve(advertised) else whose)
    return found


def list_models(services: Services, caller: Caller, policy: Policy,
                shares: tuple[ShareGrant, ...] = ()) -> list[dict[str, Any]]:
    allowed = _allowed(caller)
    if policy.never_fleet:
        owned = owned_models(services, caller.account_id, shares)
        return [_entry(model_id, owner) for model_id, owner in sorted(owned.items())
                if allowed is None or model_id in allowed]
    return [_entry(model.id, "darkbloom") for model in services.settings.catalog.models
            if (allowed is None or model.id in allowed)
            and routable_public(services.registry, model, services.settings)]


def model_entry(services: Services, caller: Caller, policy: Policy, model_id: str,
                shares: tuple[ShareGrant, ...] = ()) -> dict[str, Any]:
    listed = {entry["id"]: entry for entry in list_models(services, caller, policy, shares)}
    model = services.settings.catalog.resolve(model_id)
    key = model.id if model is not None and model.id in listed else model_id
    if key in listed:
        return {**listed[key], "id": model_id}
    raise ApiError(404, "model_not_found", f"The model '{model_id}' does not exist or is not being served.",
                   param="model")
