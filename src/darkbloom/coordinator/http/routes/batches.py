"""Batches (docs/batches.md): create, list, read, cancel."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from darkbloom.coordinator.batches import batch_api
from darkbloom.coordinator.http.auth import require_caller
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.services import Services, get_services

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request, caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    return await batch_api.create(services, caller, request.headers, await json_object(request))


@router.get("/v1/batches")
async def list_batches(limit: int = Query(20, ge=1, le=batch_api.MAX_LIST), after: str | None = None,
                       caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    return await batch_api.listed(services, caller, limit, after)


@router.get("/v1/batches/{batch_id}")
async def read_batch(batch_id: str, caller: Caller = Depends(require_caller),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    return await batch_api.read(services, caller, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    return await batch_api.cancel(services, caller, batch_id)
