"""Starlette exception handlers that answer with the OpenAI error envelope."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from darkbloom.wire.openai.errors import ApiError, error_body, retry_headers

_ROUTING_ERRORS = {
    404: ("not_found", "No route matches {path}."),
    405: ("method_not_allowed", "Method {method} is not allowed on {path}."),
}


async def api_error_handler(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, …) in the envelope, their headers kept."""
    assert isinstance(exc, HTTPException)
    type_, template = _ROUTING_ERRORS.get(exc.status_code, ("invalid_request_error", "{detail}"))
    message = template.format(path=request.url.path, method=request.method, detail=exc.detail)
    return JSONResponse(error_body(type_, message), status_code=exc.status_code,
                        headers=retry_headers(exc.status_code, exc.headers))
