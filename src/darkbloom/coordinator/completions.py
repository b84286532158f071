"""One chat completion through the coordinator: resolve model → select → seal → dispatch → relay."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.catalog import CatalogModel
from darkbloom.coordinator import relay
from darkbloom.coordinator.auth import Caller
from darkbloom.coordinator.chat_request import ChatRequest
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.scheduler import select
from darkbloom.coordinator.services import Services

log = logging.getLogger("darkbloom.completions")


def new_request_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def resolve_model(services: Services, caller: Caller, name: str) -> CatalogModel:
    model = services.settings.catalog.resolve(name)
    if model is None:
        raise ApiError(404, "model_not_found",
                       f"The model '{name}' does not exist. GET /v1/models lists the models you can use.",
                       param="model")
    allowed = caller.key.get("allowed_models") if caller.key else None
    if allowed is not None and model.id not in allowed and name not in allowed:
        raise ApiError(403, "model_not_allowed",
                       f"This API key may not use '{name}'. Edit the key's allowed models or use another key.",
                       param="model")
    return model


async def chat_completion(services: Services, caller: Caller, chat: ChatRequest,
                          request: Request) -> StreamingResponse | JSONResponse:
    request_id = new_request_id()
    started = time.monotonic()
    model = resolve_model(services, caller, chat.model)
    placement = select(services.registry, model)
    pending = relay.dispatch(placement.session, chat, placement.provider_model_id, request_id)
    headers = {"X-Request-Id": request_id, "X-Provider-Id": placement.session.id}
    shaper = relay.ChunkShaper(request_id, chat.model)
    try:
        head, completed = await _until_disconnect(
            request, relay.first_content(pending, services.settings.first_content_timeout))
    except relay.ProviderFailure as failure:
        relay.release(pending)
        _log(request_id, caller, model, placement.session.id, failure.failure.reason, started)
        error = failure.as_api_error()
        error.headers.update(headers)
        raise error from None
    except BaseException:
        relay.release(pending)
        raise

    if chat.stream:
        return StreamingResponse(_streamed(pending, head, completed, shaper, caller, model, started),
                                 media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        body = await _until_disconnect(request, relay.collect(pending, head, completed, shaper))
    except relay.ProviderFailure as failure:
        _log(request_id, caller, model, placement.session.id, failure.failure.reason, started)
        raise failure.as_api_error() from None
    finally:
        relay.release(pending)
    _log(request_id, caller, model, placement.session.id, "ok", started)
    return JSONResponse(body, headers=headers)


async def _streamed(pending: relay.PendingRequest, head: list[dict[str, Any]], completed: bool,
                    shaper: relay.ChunkShaper, caller: Caller, model: CatalogModel,
                    started: float) -> AsyncIterator[bytes]:
    outcome = "client_disconnected"
    try:
        async for part in relay.sse_events(pending, head, completed, shaper):
            yield part
        outcome = "ok" if pending.usage is not None else "failed_after_commit"
    finally:
        relay.release(pending)
        _log(pending.request_id, caller, model, pending.session.id, outcome, started)


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client goes away first (then cancel it and re-raise)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _log(request_id: str, caller: Caller, model: CatalogModel, provider_id: str, outcome: str,
         started: float) -> None:
    log.info("request_id=%s account=%s key=%s model=%s provider=%s outcome=%s ms=%d", request_id,
             caller.account_id, caller.key_id, model.id, provider_id, outcome,
             (time.monotonic() - started) * 1000)
