"""Inference routes — chat completions, the Responses API, Anthropic Messages, legacy completions,
embeddings — one handler over one pipeline (``inference.calls`` says how each API translates); and
the model list."""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.http.auth import require_caller
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.http.sealed_body import is_sealed, unseal
from darkbloom.coordinator.inference.calls import EDGES, Edge, parse_call
from darkbloom.coordinator.inference.lifecycle import RequestLifecycle
from darkbloom.coordinator.inference.pipeline import new_request_id, serve
from darkbloom.coordinator.money.admission import request_charges
from darkbloom.coordinator.routing.model_views import list_models, model_entry, owned_models
from darkbloom.coordinator.routing.policy import resolve_policy
from darkbloom.coordinator.services import Services, get_services

router = APIRouter()


async def _serve(edge: Edge, request: Request, caller: Caller, services: Services) -> StreamingResponse | JSONResponse:
    unsealed = None
    async with RequestLifecycle(services, caller, new_request_id(edge)) as life:
        request.state.request_id = life.request_id  # also on an error answer (wire.openai.handlers)
        await life.charge_rates(request_charges(services, caller))  # RPM, before the body is read
        raw = await request.body()
        if is_sealed(request.headers.get("content-type")):
            unsealed = unseal(raw, services.consumer_key)
            raw = unsealed.plaintext
        call = parse_call(raw, edge)
        response = await serve(life, call, resolve_policy(request.headers, caller), request)
    return unsealed.seal_response(response) if unsealed else response


def add_inference_routes(app: FastAPI) -> None:
    """The inference POST routes, one per edge, as plain Starlette routes: FastAPI's per-request
    machinery (dependency solving, its request and response wrappers) cost ~90 µs of the relay's ~2 ms
    per request, and these routes read their body and their caller by hand anyway. The OpenAPI
    document lists them all the same (``http.openapi``)."""
    for edge in EDGES:
        app.add_route(edge.path, _endpoint(edge), methods=["POST"],
                      name=edge.path.removeprefix("/v1/").replace("/", "_"))


def _endpoint(edge: Edge) -> Callable[[Request], Awaitable[StreamingResponse | JSONResponse]]:
    async def endpoint(request: Request) -> StreamingResponse | JSONResponse:
        services: Services = request.app.state.services
        return await _serve(edge, request, await require_caller(request, services), services)
    return endpoint


@router.get("/v1/models")
async def models(request: Request, caller: Caller = Depends(require_caller),
                 services: Services = Depends(get_services)) -> dict[str, object]:
    policy = resolve_policy(request.headers, caller, with_pin=False)
    return {"object": "list", "data": list_models(services, caller, policy)}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request, caller: Caller = Depends(require_caller),
                services: Services = Depends(get_services)) -> dict[str, object]:
    policy = resolve_policy(request.headers, caller, with_pin=False)
    return model_entry(services, caller, policy, model_id)


@router.get("/v1/me/self-route-models")
async def self_route_models(caller: Caller = Depends(require_caller),
                            services: Services = Depends(get_services)) -> dict[str, list[str]]:
    return {"models": sorted(owned_models(services, caller.account_id))}
