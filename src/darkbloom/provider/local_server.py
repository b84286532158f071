"""Direct mode (CONTRACT §8): an OpenAI-compatible server on the node itself.

`GET /health` (open), `GET /v1/models`, `GET /v1/models/{id}` and `POST /v1/chat/completions`
(streamed or not, `usage` always included), every route but `/health` behind
`Authorization: Bearer dk-local-…`. Requests run on the node's own backend and take a slot of the
node's one `max_concurrency` (`Slots`), shared with fleet requests; a direct request waits up to
`queue_wait` seconds for one, then gets 429. Nothing here knows about accounts or billing, and no
byte of a direct request leaves the machine. Logs carry request ids and token counts only.

Streams follow the coordinator's rules: nothing is sent before the first content chunk (so an
early failure is a real HTTP error), a final chunk with `usage`, one `data: [DONE]`; a failure
after the first chunk ends the stream with one `data: {"error": …}` event and no `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from darkbloom import crypto
from darkbloom.openai_chunks import SSE_DONE, MessageBuilder, sse
from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.backends.base import UsageMeter, is_usage_chunk
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
QUEUE_WAIT = 120.0  # seconds a direct request may wait for a free slot
STOP_GRACE = 5.0  # after a stream ends early, how long the slot waits for the backend to stop
MODEL_CREATED = 1735689600

# TEST HOOK — never set in production. `DARKBLOOM_TEST_LOCAL_FAIL=<4xx|5xx status>` makes every
# authenticated POST /v1/chat/completions answer that status (an OpenAI error envelope, code
# `test_hook`) without touching the backend, so tests can show that the direct-first client
# returns a local error instead of falling back. Off unless the variable is set.
TEST_FAIL_ENV = "DARKBLOOM_TEST_LOCAL_FAIL"


def test_fail_status_from_env() -> int | None:
    raw = os.environ.get(TEST_FAIL_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 400 <= int(raw) <= 599:
        raise ValueError(f"{TEST_FAIL_ENV} must be an HTTP error status between 400 and 599, not {raw!r}")
    return int(raw)


class LocalApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.code = code if code is not None else type_
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_BACKEND_ERROR_TYPES = {400: "invalid_request_error", 404: "model_not_found", 413: "request_too_large",
                        429: "rate_limit_exceeded"}


def _from_backend(exc: BackendError) -> LocalApiError:
    default = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return LocalApiError(exc.status_code, _BACKEND_ERROR_TYPES.get(exc.status_code, default), exc.message)


def create_app(backend: Backend, slots: Slots, model_ids: list[str], token: str, *,
               fail_status: int | None = None, queue_wait: float = QUEUE_WAIT) -> ASGIApp:
    api = _LocalApi(backend, slots, list(model_ids), fail_status, queue_wait)
    app = Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    ], exception_handlers={LocalApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
    return _BearerAuth(app, token)


class _BearerAuth:
    """401 `invalid_api_key` on every path but /health unless the bearer token matches."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            given = given.strip()
            if scheme.lower() != "bearer" or not given:
                message = ("Missing direct-mode token. Pass 'Authorization: Bearer dk-local-…'; the token is "
                           "in $DARKBLOOM_HOME/local_token (and local.json) on the node.")
            elif not crypto.constant_time_equal(given, self.token):
                message = ("Invalid direct-mode token. Use the token in $DARKBLOOM_HOME/local_token "
                           "(or local.json) on the node.")
            else:
                message = ""
            if message:
                response = LocalApiError(401, "invalid_api_key", message, headers={"WWW-Authenticate": "Bearer"})
                await response.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LocalApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = LocalApiError(404, "not_found", f"No route matches {request.url.path}.")
    elif exc.status_code == 405:
        error = LocalApiError(405, "method_not_allowed", f"Method {request.method} is not allowed on "
                                                         f"{request.url.path}.")
    else:
        error = LocalApiError(exc.status_code, "invalid_request_error", str(exc.detail))
    return error.response()


async def _server_error(_request: Request, exc: Exception) -> Response:
    log.error("direct-mode request failed", exc_info=exc)
    return LocalApiError(500, "server_error", "The node failed while serving this request.").response()


class _LocalApi:
    def __init__(self, backend: Backend, slots: Slots, model_ids: list[str], fail_status: int | None,
                 queue_wait: float) -> None:
        self.backend, self.slots, self.model_ids = backend, slots, model_ids
        self.fail_status, self.queue_wait = fail_status, queue_wait

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_entry(m) for m in self.model_ids]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self.model_ids:
            raise _model_not_found(model_id)
        return JSONResponse(_model_entry(model_id))

    async def chat_completions(self, request: Request) -> Response:
        body = await _json_object(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise LocalApiError(400, "invalid_request_error", "model is required: a model id from GET /v1/models.",
                                param="model")
        if model not in self.model_ids:
            raise _model_not_found(model)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise LocalApiError(400, "invalid_request_error", "stream must be true or false.", param="stream")
        if self.fail_status is not None:
            raise LocalApiError(self.fail_status, "server_error" if self.fail_status >= 500 else
                                "invalid_request_error",
                                f"{TEST_FAIL_ENV} is set on this node: direct mode answers {self.fail_status} "
                                "to every chat completion (test hook).", code="test_hook")
        if not await self.slots.acquire(self.queue_wait):
            raise LocalApiError(429, "rate_limit_exceeded",
                                f"This node is busy (all {self.slots.limit} slots in use) and no slot freed up "
                                f"within {self.queue_wait:g} s. Retry shortly.", headers={"Retry-After": "5"})
        generation = _Generation(self.backend, model, body, self.slots)
        headers = {"X-Request-Id": generation.request_id}
        handed_off = False
        try:
            if stream:
                head = await generation.head()
                handed_off = True
                return _GenerationResponse(generation, _events(generation, head), headers=headers)
            return JSONResponse(await generation.collect(), headers=headers)
        except BackendError as exc:
            raise _from_backend(exc) from None
        finally:
            if not handed_off:
                generation.finish_soon()


def _model_entry(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": MODEL_CREATED, "owned_by": "self"}


def _model_not_found(model_id: str) -> LocalApiError:
    return LocalApiError(404, "model_not_found", f"The model '{model_id}' is not served by this node. "
                         "GET /v1/models lists the models it serves.", param="model")


async def _json_object(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise LocalApiError(413, "request_too_large", "The request body is larger than 8 MiB.")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise LocalApiError(413, "request_too_large", "The request body is larger than 8 MiB.")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise LocalApiError(400, "invalid_request_error", "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise LocalApiError(400, "invalid_request_error", "The request body must be a JSON object.")
    return body


_tasks: set[asyncio.Task[None]] = set()  # strong references to the slot-release tasks


class _Generation:
    """One direct request on the backend. It holds a slot from before it starts until the backend
    has stopped generating (`finish_soon`, exactly once, whatever way the request ends)."""

    def __init__(self, backend: Backend, model: str, body: dict[str, Any], slots: Slots) -> None:
        self.request_id = "chatcmpl-" + secrets.token_hex(12)
        self.model = model
        self.created = int(time.time())
        self.meter = UsageMeter()
        self.slots = slots
        self.usage: dict[str, int] | None = None
        self.started = time.monotonic()
        self._stream = backend.stream_chat(model, body, self.meter)
        self._finishing = False

    def _shape(self, chunk: dict[str, Any]) -> dict[str, Any]:
        chunk.update(id=self.request_id, model=self.model, object="chat.completion.chunk")
        chunk.setdefault("created", self.created)
        return chunk

    async def next_chunk(self) -> dict[str, Any] | None:
        """The next content chunk, shaped; None at the end (the usage chunk is kept in `self.usage`)."""
        while True:
            try:
                chunk = await anext(self._stream)
            except StopAsyncIteration:
                return None
            if not is_usage_chunk(chunk):
                return self._shape(chunk)
            usage = chunk["usage"]
            prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
            self.usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def head(self) -> list[dict[str, Any]]:
        """Chunks up to the first one with content or a finish reason (or the end of the stream)."""
        head: list[dict[str, Any]] = []
        while (chunk := await self.next_chunk()) is not None:
            head.append(chunk)
            if any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in chunk["choices"]):
                break
        return head

    async def collect(self) -> dict[str, Any]:
        message = MessageBuilder()
        async for chunk in self.chunks():
            message.add(chunk)
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [message.choice()], "usage": self.final_usage()}

    def final_usage(self) -> dict[str, int]:
        if self.usage is None:
            raise BackendError(502, "the backend finished without reporting token usage")
        return self.usage

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": self.final_usage()}

    def finish_soon(self) -> None:
        """Stop the backend (if still running) and free the slot once it has stopped, in a task of its
        own so that neither a cancelled response nor a vanished client can skip it."""
        if self._finishing:
            return
        self._finishing = True
        task = asyncio.get_running_loop().create_task(self._finish(), name=f"finish-{self.request_id}")
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)

    async def _finish(self) -> None:
        try:
            try:
                await self._stream.aclose()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - closing a failed stream may re-raise; nothing to add
                pass
            if not await self.meter.stopped(STOP_GRACE):
                log.warning("direct request %s: the backend did not stop within %.0f s", self.request_id,
                            STOP_GRACE)
        finally:
            self.slots.release()
        usage = self.usage or {"prompt_tokens": self.meter.prompt_tokens,
                               "completion_tokens": self.meter.completion_tokens}
        log.info("direct request %s for %s: %d prompt + %d completion tokens, %.0f ms%s", self.request_id,
                 self.model, usage["prompt_tokens"], usage["completion_tokens"],
                 (time.monotonic() - self.started) * 1000, "" if self.usage else " (stopped early)")


async def _events(generation: _Generation, head: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield sse(chunk)
    try:
        async for chunk in generation.chunks():
            yield sse(chunk)
        final = generation.usage_chunk()
    except BackendError as exc:
        yield sse(_from_backend(exc).body())
        return
    except Exception:  # noqa: BLE001 - the stream has started: report in-band, no [DONE]
        log.exception("direct request %s failed mid-stream", generation.request_id)
        yield sse(LocalApiError(500, "server_error", "The node failed while serving this request.").body())
        return
    yield sse(final)
    yield SSE_DONE


class _GenerationResponse(StreamingResponse):
    """A streamed completion that always hands its slot back, however the response ends."""

    def __init__(self, generation: _Generation, content: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.finish_soon()
