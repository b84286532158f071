"""The OpenAI error envelope and the one exception every layer raises to produce it (coordinator and
direct mode alike)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


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
