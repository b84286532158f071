"""The OpenAI error envelope and the one exception every layer raises to produce it (coordinator and
direct mode alike)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


# Errors a retry cannot fix (docs/api.md "Errors and retries"): SDKs read this header and stop retrying them.
NOT_RETRYABLE = frozenset({400, 401, 402, 403, 404, 409})


def retry_headers(status: int, headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus ``x-should-retry: false`` when a retry of this status cannot succeed."""
    merged = dict(headers or {})
    if status in NOT_RETRYABLE:
        merged.setdefault("x-should-retry", "false")
    return merged


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
        return JSONResponse(self.body(), status_code=self.status, headers=retry_headers(self.status, self.headers))


def error_body(type_: str, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code if code is not None else type_,
                      "param": param}}


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param=param)


def unauthorized(message: str = "Missing or invalid API key. Pass it as 'Authorization: Bearer dk-…'.") -> ApiError:
    return ApiError(401, "invalid_api_key", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(type_: str, message: str) -> ApiError:
    return ApiError(404, type_, message)
