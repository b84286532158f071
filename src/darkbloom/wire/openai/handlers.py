"""Starlette exception handlers that answer with the OpenAI error envelope."""

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


# Paths that answer errors in Anthropic's envelope rather than OpenAI's (coordinator and direct mode).
ANTHROPIC_PATHS = frozenset({"/v1/messages"})


def error_response(request: Request, error: ApiError) -> Response:
    """The error in the envelope of the API the request was for, with the request's id when it got
    one (``request.state.request_id``: an inference request past authentication)."""
    request_id = getattr(request.state, "request_id", None)
    headers = {**error.headers, "X-Request-Id": request_id} if request_id else error.headers
    body = anthropic_error_body(error) if request.url.path in ANTHROPIC_PATHS else error.body()
    return JSONResponse(body, status_code=error.status, headers=retry_headers(error.status, headers))


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, …) in the envelope, their headers kept."""
    assert isinstance(exc, HTTPException)
    type_, template = _ROUTING_ERRORS.get(exc.status_code, ("invalid_request_error", "{detail}"))
    message = template.format(path=request.url.path, method=request.method, detail=exc.detail)
    return error_response(request, ApiError(exc.status_code, type_, message, headers=exc.headers))
