"""Starlette exception handlers, and the one place that picks an error's envelope: Anthropic's for
the Messages API (`/v1/messages` and every path under it), OpenAI's everywhere else."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from darkbloom.wire.openai.anthropic_messages import anthropic_error_body
from darkbloom.wire.openai.errors import ApiError, retry_headers

_ROUTING_ERRORS = {
    404: ("not_found", "No route matches {path}."),
    405: ("method_not_allowed", "Method {method} is not allowed on {path}."),
}

ANTHROPIC_ROOT = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether ``path`` belongs to Anthropic's Messages API (coordinator and direct mode): its errors
    go in Anthropic's envelope and its key may come as ``x-api-key``, as Anthropic's clients send it."""
    return path == ANTHROPIC_ROOT or path.startswith(ANTHROPIC_ROOT + "/")


def path_error_response(path: str, error: ApiError, request_id: str | None = None) -> JSONResponse:
    """The error answered on ``path`` in that API's envelope (also usable as a raw ASGI answer)."""
    headers = {**error.headers, "X-Request-Id": request_id} if request_id else error.headers
    body = anthropic_error_body(error) if speaks_anthropic(path) else error.body()
    return JSONResponse(body, status_code=error.status,
                        headers=retry_headers(error.status, headers))


def error_response(request: Request, error: ApiError) -> Response:
    """The error in the envelope of the API the request was for, with the request's id when it got
    one (``request.state.request_id``: an inference request past authentication)."""
    return path_error_response(request.url.path, error, getattr(request.state, "request_id", None))


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, …) in the envelope, their headers kept."""
    assert isinstance(exc, HTTPException)
    type_, template = _ROUTING_ERRORS.get(exc.status_code, ("invalid_request_error", "{detail}"))
    message = template.format(path=request.url.path, method=request.method, detail=exc.detail)
    return error_response(request, ApiError(exc.status_code, type_, message, headers=exc.headers))
