"""Inference routes — chat completions, the Responses API, Anthropic Messages, legacy completions,
embeddings — one handler that hands each request to ``inference.serving.serve`` (``wire.openai.edges``
says how each API translates); Anthropic's token count; and the model list."""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.http.auth import require_caller
from darkbloom.coordinator.http.sealed_body import SEALED_CONTENT_TYPE, Unsealed, unseal
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.serving import serve
from darkbloom.coordinator.inference.token_count import count_input_tokens
from darkbloom.coordinator.money.admission import take_request
from darkbloom.coordinator.routing.model_views import list_models, model_entry, owned_models
from darkbloom.coordinator.routing.decision import Policy, ShareGrant
from darkbloom.coordinator.routing.route import resolve_policy
from darkbloom.coordinator.routing.sharing import load_grants
from darkbloom.coordinator.services import Services, get_services
from darkbloom.wire.openai.edges import EDGES, Edge

router = APIRouter()


def add_inference_routes(app: FastAPI) -> None:
    """The inference POST routes, one per edge, as plain Starlette routes: FastAPI's per-request
    machinery (dependency solving, its request and response wrappers) was a measurable part of the
    relay's cost per request (bench/RESULTS.md), and these routes read their body and their caller by
    hand anyway. The OpenAPI
    document lists them all the same (``http.openapi``)."""
    for edge in EDGES:
        app.add_route(edge.path, _endpoint(edge), methods=["POST"],
                      name=edge.path.removeprefix("/v1/").replace("/", "_"))


def _endpoint(edge: Edge) -> Callable[[Request], Awaitable[StreamingResponse | JSONResponse]]:
    async def endpoint(request: Request) -> StreamingResponse | JSONResponse:
        services: Services = request.app.state.services
        caller = await require_caller(request, services)
        body = _Body(request, services)
        return body.answered(await serve(edge, request, caller, services, body.read))
    return endpoint


class _Body:
    """A request's body as the serving function reads it (after the RPM charge): opened when it came
    sealed to the coordinator's key, whose answer then goes back sealed the same way."""

    def __init__(self, request: Request, services: Services) -> None:
        self._request = request
        self._services = services
        self._unsealed: Unsealed | None = None

    async def read(self) -> bytes:
        raw = await self._request.body()
        media_type = self._request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != SEALED_CONTENT_TYPE:
            return raw
        assert self._services.consumer_key is not None, "loaded at start"
        self._unsealed = unseal(raw, self._services.consumer_key)
        return self._unsealed.plaintext

    def answered(self, response: StreamingResponse | JSONResponse) -> StreamingResponse | JSONResponse:
        return self._unsealed.seal_response(response) if self._unsealed else response


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, response: Response, caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> dict[str, int]:
    response.headers.update(await take_request(services, caller))  # RPM, before the body is read
    return count_input_tokens(services, caller, request.headers, await request.body())


@router.get("/v1/models")
async def models(request: Request, caller: Caller = Depends(require_caller),
                 services: Services = Depends(get_services)) -> dict[str, object]:
    policy = resolve_policy(request.headers, caller, with_pin=False)
    return {"object": "list", "data": list_models(services, caller, policy, await _shares(services, caller, policy))}


async def _shares(services: Services, caller: Caller, policy: Policy) -> tuple[ShareGrant, ...]:
    return (await load_grants(services, caller, None)).usable if policy.shared else ()


@router.get("/v1/models/catalog")
async def model_catalog(services: Services = Depends(get_services)) -> dict[str, object]:
    """The catalog with prices and where each model's weights come from; public, like a price list
    (docs/models.md "The catalog")."""
    return {"object": "list",
            "data": [m.model_dump(exclude_none=True) for m in services.settings.catalog.models]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request, caller: Caller = Depends(require_caller),
                services: Services = Depends(get_services)) -> dict[str, object]:
    policy = resolve_policy(request.headers, caller, with_pin=False)
    return model_entry(services, caller, policy, model_id, await _shares(services, caller, policy))


@router.get("/v1/me/self-route-models")
async def self_route_models(caller: Caller = Depends(require_caller),
                            services: Services = Depends(get_services)) -> dict[str, list[str]]:
    return {"models": sorted(owned_models(services, caller.account_id))}
