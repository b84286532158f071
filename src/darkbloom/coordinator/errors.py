"""The OpenAI error envelope and the one exception every layer raises to produce it."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.code = code if code is not None else type_
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.type, self.message, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(type_: str, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code if code is not None else type_,
                      "param": param}}


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param=param)


def unauthorized(message: str = "Missing or invalid API key. Pass it as 'Authorization: Bearer dk-…'.") -> ApiError:
    return ApiError(401, "invalid_api_key", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(type_: str, message: str) -> ApiError:
    return ApiError(404, type_, message)


_STATUS_TYPES = {
    404: ("not_found", "No route matches {path}."),
    405: ("method_not_allowed", "Method {method} is not allowed on {path}."),
    413: ("request_too_large", "The request body is larger than 8 MiB."),
}


async def _api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_, template = _STATUS_TYPES.get(exc.status_code, ("invalid_request_error", "{detail}"))
    message = template.format(path=request.url.path, method=request.method, detail=exc.detail)
    return JSONResponse(error_body(type_, message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _validation_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        message = "The request body is not valid JSON."
        param = None
    return JSONResponse(error_body("invalid_request_error", message, param=param), status_code=400)


_PG_CHARACTER_NOT_IN_REPERTOIRE = "22021"  # e.g. a NUL character, which Postgres text cannot hold
NUL_MESSAGE = "Text in the request must not contain NUL (\\u0000) characters."


async def _database_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DBAPIError)
    if getattr(exc.orig, "sqlstate", None) == _PG_CHARACTER_NOT_IN_REPERTOIRE:
        return invalid_request(NUL_MESSAGE).response()
    raise exc


def install_handlers(app: Any) -> None:
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(DBAPIError, _database_error_handler)
