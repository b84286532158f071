"""CORS for browser apps calling the API directly (``--cors-origins``, docs/api.md "CORS"): Starlette's
middleware, answering preflights and exposing the headers a client acts on."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from darkbloom.wire.openai.errors import ApiError

EXPOSED = ["X-Request-Id", "X-Provider-Id", "X-Darkbloom-Routed", "X-Darkbloom-Billing", "Retry-After",
           "x-should-retry", *(f"x-ratelimit-{what}-{dimension}" for dimension in
                                ("requests", "tokens", "input-tokens", "output-tokens")
                                for what in ("limit", "remaining", "reset"))]


class _EnvelopeCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the OpenAI envelope like every error."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode()
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return ApiError(400, "cors_refused", f"{refused}: this origin, method or header is not allowed "
                                             "by the coordinator's --cors-origins.", headers=headers).response()


def allowed_origins(setting: str | None) -> list[str]:
    return [origin.strip().rstrip("/") for origin in (setting or "").split(",") if origin.strip()]


def add_cors(app: FastAPI, setting: str | None) -> None:
    """Nothing when no origin is configured (the default): browsers then refuse cross-origin calls."""
    origins = allowed_origins(setting)
    if origins:
        # bearer tokens, never cookies: no credentials mode, so "*" is a valid answer to any origin
        app.add_middleware(_EnvelopeCORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=EXPOSED, max_age=600)
