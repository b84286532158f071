"""Exception handlers: every error the HTTP layer can raise answers in its API's envelope (the
shared handlers of ``wire.openai`` plus the coordinator's own: request validation, database errors,
and a 500 for whatever nothing foresaw)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.wire.openai.handlers import api_error_handler, error_response, http_error_handler

log = logging.getLogger("darkbloom.coordinator")
SERVER_ERROR_MESSAGE = ("The coordinator failed on this request with an internal error, which it logged. Retry; "
                        "if it keeps failing, tell the coordinator's operator (with this answer's X-Request-Id "
                        "header, when it has one).")


async def _validation_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        message = "The request body is not valid JSON."
        param = None
    return error_response(request, invalid_request(message, param=param))


_PG_CHARACTER_NOT_IN_REPERTOIRE = "22021"  # e.g. a NUL character, which Postgres text cannot hold
NUL_MESSAGE = "Text in the request must not contain NUL (\\u0000) characters."


async def _database_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DBAPIError)
    if getattr(exc.orig, "sqlstate", None) == _PG_CHARACTER_NOT_IN_REPERTOIRE:
        return error_response(request, invalid_request(NUL_MESSAGE))
    raise exc


async def _unexpected_handler(request: Request, exc: Exception) -> Response:
    """Whatever no other handler answers: 500 ``server_error`` in the API's envelope, with the
    request's id once it has one, never Starlette's plain text. Starlette raises the exception again
    once this answer is sent, so the server logs its traceback."""
    log.error("%s %s failed (request %s): %s", request.method, request.url.path,
              getattr(request.state, "request_id", None) or "-", type(exc).__name__)
    return error_response(request, ApiError(500, "server_error", SERVER_ERROR_MESSAGE))


def install_handlers(app: Any) -> None:
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(DBAPIError, _database_error_handler)
    app.add_exception_handler(Exception, _unexpected_handler)  # Starlette's ServerErrorMiddleware calls it
