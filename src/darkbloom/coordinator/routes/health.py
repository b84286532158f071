"""Liveness, readiness, metrics and the coordinator's public encryption key."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import ping

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: Services = Depends(get_services)) -> JSONResponse:
    if await ping(services.engine):
        return JSONResponse({"status": "ready", "database": "ok"})
    return JSONResponse({"status": "not_ready", "database": "unreachable"}, status_code=503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
