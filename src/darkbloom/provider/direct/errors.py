"""Direct mode's errors, in the shared OpenAI envelope (`wire.openai.errors.ApiError`)."""

from __future__ import annotations

from darkbloom.wire.openai.errors import ApiError
from darkbloom.provider.backends import BackendError

_BACKEND_ERROR_TYPES = {400: "invalid_request_error", 404: "model_not_found", 413: "request_too_large",
                        429: "rate_limit_exceeded"}


def from_backend(exc: BackendError) -> ApiError:
    default = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, _BACKEND_ERROR_TYPES.get(exc.status_code, default), exc.message,
                    code=exc.code, param=exc.param)


def node_failed() -> ApiError:
    return ApiError(500, "server_error", "The node failed while serving this request.")


def model_not_found(model_id: str) -> ApiError:
    return ApiError(404, "model_not_found", f"The model '{model_id}' is not served by this node. "
                    "GET /v1/models lists the models it serves.", param="model")
