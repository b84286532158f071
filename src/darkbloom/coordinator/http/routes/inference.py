"""Inference routes — chat completions, the Responses API, Anthropic Messages, legacy completions,
embeddings — one handler over one pipeline (``inference.calls`` says how each API translates); and
the model list."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.http.auth import Caller, require_caller
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


def _route(edge: Edge) -> None:
    async def endpoint(request: Request, caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> StreamingResponse | JSONResponse:
        return await _serve(edge, request, caller, services)

    endpoint.__name__ = edge.path.removeprefix("/v1/").replace("/", "_")
    router.add_api_route(edge.path, endpoint, methods=["POST"], response_model=None)


for _edge in EDGES:
    _route(_edge)


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
