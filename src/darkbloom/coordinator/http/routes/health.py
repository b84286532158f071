"""Public endpoints: liveness, readiness, metrics and the coordinator's encryption key."""

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
    """Ready while the database answers. With replicas it also says whether NATS is connected, how
    many replicas it hears and whether it sees all their sessions (``fabric``: ``in_sync`` or
    ``out_of_sync``, with ``unsynced_replicas``); a replica without NATS, or out of step with another,
    still serves its own sessions, so that alone does not make it unready (a load balancer taking
    every replica out when NATS is down would strand every node)."""
    fabric = services.fabric.status() if services.fabric is not None else {}
    if await ping(services.engine):
        return JSONResponse({"status": "ready", "database": "ok", **fabric})
    return JSONResponse({"status": "not_ready", "database": "unreachable", **fabric}, status_code=503)


@router.get("/v1/encryption-key")
async def encryption_key(services: Services = Depends(get_services)) -> dict[str, str]:
    """The key a client may seal request bodies to (docs/api.md "Sealed bodies")."""
    assert services.consumer_key is not None, "loaded at start"
    return services.consumer_key.public_view()


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
