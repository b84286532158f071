"""What GET /v1/models shows: catalog models with at least one routable public provider."""

from __future__ import annotations

from typing import Any

from darkbloom.coordinator.auth import Caller
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.scheduler import routable_public
from darkbloom.coordinator.services import Services

CREATED = 1735689600  # a fixed date: catalog entries carry no creation time


def list_models(services: Services, caller: Caller) -> list[dict[str, Any]]:
    allowed = caller.key.get("allowed_models") if caller.key else None
    entries = []
    for model in services.settings.catalog.models:
        if allowed is not None and model.id not in allowed:
            continue
        if routable_public(services.registry, model, services.settings):
            entries.append({"id": model.id, "object": "model", "created": CREATED, "owned_by": "darkbloom"})
    return entries


def model_entry(services: Services, caller: Caller, model_id: str) -> dict[str, Any]:
    for entry in list_models(services, caller):
        if entry["id"] == model_id:
            return entry
    model = services.settings.catalog.resolve(model_id)
    if model is not None and any(e["id"] == model.id for e in list_models(services, caller)):
        return {"id": model_id, "object": "model", "created": CREATED, "owned_by": "darkbloom"}
    raise ApiError(404, "model_not_found", f"The model '{model_id}' does not exist or is not being served.",
                   param="model")
