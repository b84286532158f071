"""Direct mode (docs/direct-mode.md "Serving it"): an OpenAI-compatible server on the node itself.

`GET /health` (open), `GET /v1/models`, `GET /v1/models/{id}`, and the inference APIs
`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses` and `/v1/messages`
(Anthropic's, answering errors in Anthropic's envelope), every route but `/health` behind
`Authorization: Bearer dk-local-…` (on `/v1/messages` also `x-api-key: dk-local-…`, as Anthropic
clients send it). Each API is the same translation at the edge as on the coordinator
(`wire.openai`: a request translator and a presenter) over one `Generation`. Requests run on the
node's own backend and take a slot of the node's one `max_concurrency` (`Slots`), shared with fleet
requests; a direct request waits up to `queue_wait` seconds for one, then gets 429. Nothing here
knows about accounts or billing, and no byte of a direct request leaves the machine. Logs carry
request ids and token counts only.

The edge (error envelopes, body reading, presenters) is the coordinator's, from `wire.openai`;
streams follow its rules too (see `generation`).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from darkbloom.wire import crypto
from darkbloom.wire.openai.answers import JsonAnswer
from darkbloom.wire.openai.body import DEFAULT_MAX_BODY_BYTES, read_json_object
from darkbloom.wire.openai.edges import EDGES, Edge
from darkbloom.wire.openai.errors import ApiError, unauthorized
from darkbloom.wire.openai.handlers import (api_error_handler, error_response, http_error_handler,
                                            path_error_response, speaks_anthropic)
from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.direct.errors import from_backend, model_not_found, node_failed
from darkbloom.provider.direct.generation import Generation, generation_response
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)

QUEUE_WAIT = 120.0  # seconds a direct request may wait for a free slot
MODEL_CREATED = 1735689600


def create_app(backend: Backend, slots: Slots, model_ids: list[str], token: str, *,
               queue_wait: float = QUEUE_WAIT, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    api = _LocalApi(backend, slots, list(model_ids), queue_wait, max_body_bytes)
    app = Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        *(Route(edge.path, api.endpoint(edge), methods=["POST"]) for edge in EDGES),
    ], exception_handlers={ApiError: api_error_handler, HTTPException: http_error_handler,
                           Exception: _server_error})
    return _BearerAuth(app, token)


class _BearerAuth:
    """401 `invalid_api_key` on every path but /health unless the bearer token matches (on Anthropic's
    paths the token may come as `x-api-key` instead, and the 401 is in Anthropic's envelope)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = Headers(scope=scope)
            anthropic = speaks_anthropic(scope["path"])
            api_key = headers.get("x-api-key", "").strip() if anthropic else ""
            message = self._refusal(f"Bearer {api_key}" if api_key else headers.get("authorization", ""))
            if message:
                await path_error_response(scope["path"], unauthorized(message))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, authorization: str) -> str:
        scheme, _, given = authorization.partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return ("Missing direct-mode token. Pass 'Authorization: Bearer dk-local-…'; the token is "
                    "in $DARKBLOOM_HOME/local_token (and local.json) on the node.")
        if not crypto.constant_time_equal(given, self.token):
            return ("Invalid direct-mode token. Use the token in $DARKBLOOM_HOME/local_token "
                    "(or local.json) on the node.")
        return ""


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("direct-mode request failed", exc_info=exc)
    return error_response(request, node_failed())


class _LocalApi:
    def __init__(self, backend: Backend, slots: Slots, model_ids: list[str], queue_wait: float,
                 max_body_bytes: int) -> None:
        self.backend, self.slots, self.model_ids = backend, slots, model_ids
        self.queue_wait, self.max_body_bytes = queue_wait, max_body_bytes

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_entry(m) for m in self.model_ids]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self.model_ids:
            raise model_not_found(model_id)
        return JSONResponse(_model_entry(model_id))

    def endpoint(self, edge: Edge) -> Callable[[Request], Any]:
        async def serve(request: Request) -> Response:
            return await self.infer(request, edge)
        return serve

    async def infer(self, request: Request, edge: Edge) -> Response:
        body = await read_json_object(request, self.max_body_bytes)
        node_body = edge.to_node(body)  # each API's schema, as on the coordinator
        model: str = body["model"]
        if model not in self.model_ids:
            raise model_not_found(model)
        stream = bool(body.get("stream")) if edge.streams else False
        node_body = dict(node_body, model=model) if edge.api == "embeddings" else dict(node_body, model=model,
                                                                                        stream=True)
        if not await self.slots.acquire(self.queue_wait):
            raise ApiError(429, "rate_limit_exceeded",
                           f"This node is busy (all {self.slots.limit} slots in use) and no slot freed up "
                           f"within {self.queue_wait:g} s. Retry shortly.", headers={"Retry-After": "5"})
        request_id = edge.id_prefix + secrets.token_hex(12)
        request.state.request_id = request_id  # also on an error answer (wire.openai.handlers)
        try:
            generation = Generation(self.backend, edge.api, model, node_body, edge.presenter(request_id, model, body),
                                    request_id, self.slots)
        except BackendError as exc:
            self.slots.release()
            raise from_backend(exc) from None
        headers = {"X-Request-Id": request_id}
        handed_off = False
        try:
            if stream:
                head = await generation.head()
                handed_off = True
                return generation_response(generation, head, headers)
            return JsonAnswer(await generation.collect(), headers=headers)
        except BackendError as exc:
            raise from_backend(exc) from None
        finally:
            if not handed_off:
                generation.answer_ended()


def _model_entry(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": MODEL_CREATED, "owned_by": "self"}
