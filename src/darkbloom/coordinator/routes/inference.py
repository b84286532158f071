"""OpenAI-compatible inference routes: chat completions and the model list."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.admission import admit_request_rate, release_rates
from darkbloom.coordinator.auth import Caller, require_caller
from darkbloom.coordinator.chat_request import parse_chat_request
from darkbloom.coordinator.completions import chat_completion
from darkbloom.coordinator.model_list import list_models, model_entry, owned_models
from darkbloom.coordinator.sealed_body import is_sealed, unseal
from darkbloom.coordinator.selfroute import resolve_policy
from darkbloom.coordinator.services import Services, get_services

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, caller: Caller = Depends(require_caller),
                           services: Services = Depends(get_services)) -> StreamingResponse | JSONResponse:
    admission = await admit_request_rate(services, caller)
    unsealed = None
    try:
        raw = await request.body()
        if is_sealed(request.headers.get("content-type")):
            unsealed = unseal(raw, services.consumer_key)
            raw = unsealed.plaintext
        chat = parse_chat_request(raw)
    except BaseException:
        await release_rates(services, admission)
        raise
    response = await chat_completion(services, caller, chat, request, admission)
    return unsealed.seal_response(response) if unsealed else response


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
