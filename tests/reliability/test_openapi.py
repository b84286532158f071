"""The coordinator's OpenAPI document (GET /openapi.json) and its OPTIONS / 405 answers (issue 12).

The document must be valid OpenAPI, name every route of the app with its request body, every error
status with the OpenAI envelope and the Self-Route headers; OPTIONS must answer 204 with every
method of the path, and a wrong method 405 with the same ``Allow``, CORS or not. The app is driven
in process (nothing here needs the lifespan: no route handler runs).
"""

from __future__ import annotations

import re
from typing import Any, AsyncIterator

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.http.allowed_methods import http_routes
from darkbloom.coordinator.http.openapi.schemas import ERROR_ENVELOPE
from darkbloom.wire.openai.errors import ApiError, error_body

HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
BODYLESS_WRITES = {("post", "/v1/auth/logout"), ("post", "/v1/device/code"),
                   ("delete", "/v1/keys/{key_id}"), ("post", "/v1/keys/{key_id}/rotate"),
                   ("delete", "/v1/me/providers/{machine_id}"),
                   ("post", "/v1/admin/machines/{machine_id}/enroll"), ("post", "/v1/me/email/send-code"),
                   ("post", "/v1/batches/{batch_id}/cancel")}
UPLOADS = {("post", "/v1/files")}  # multipart bodies


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(CoordinatorSettings()).openapi()


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, item in document["paths"].items()
            for method, op in item.items() if method in HTTP_METHODS]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(CoordinatorSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as http:
        yield http


def test_the_document_is_valid_openapi(document: dict[str, Any]) -> None:
    validate(document)


async def test_it_is_served_at_openapi_json(client: httpx.AsyncClient, document: dict[str, Any]) -> None:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == document


def test_every_route_of_the_app_is_in_it(document: dict[str, Any]) -> None:
    app = create_app(CoordinatorSettings())
    routes = {(method.lower(), re.sub(r"{(\w+):\w+}", r"{\1}", route.path))
              for route in http_routes(app.routes) for method in (getattr(route, "methods", None) or ())
              if method != "HEAD"}  # Starlette's implicit HEAD beside GET /openapi.json
    documented = {(method, path) for method, path, _ in _operations(document)}
    assert routes - documented == set(), "routes missing from the document"
    assert documented - routes == set(), "documented operations the app does not serve"
    assert ("post", "/v1/chat/completions") in documented and ("put", "/v1/admin/catalog") in documented


def test_every_error_is_the_envelope(document: dict[str, Any]) -> None:
    for method, path, op in _operations(document):
        for status, response in op["responses"].items():
            if int(status) < 400 or (path, status) == ("/readyz", "503"):  # readiness answers its own shape
                continue
            envelope = "AnthropicError" if path.startswith("/v1/messages") else "Error"  # each API its own envelope
            assert response["content"] == {"application/json": {"schema": {"$ref": f"#/components/schemas/{envelope}"}}}, \
                (method, path, status)
            assert "error.code" in response["description"], (method, path, status)
            if int(status) in (400, 401, 402, 403, 404, 409):
                assert "x-should-retry" in response["headers"], (method, path, status)
        assert "413" in op["responses"], (method, path)
        assert "422" not in op["responses"], (method, path)  # validation errors are 400s here


def test_the_error_schema_holds_every_real_error() -> None:
    samples = [error_body("invalid_request_error", "bad", param="model"),
               ApiError(402, "insufficient_funds", "poor", code="insufficient_quota").body(),
               error_body("request_too_large", "big"), error_body("client_disconnected", "gone")]
    for body in samples:
        jsonschema.validate(body, ERROR_ENVELOPE)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"detail": "FastAPI's own shape"}, ERROR_ENVELOPE)


def test_auth_and_bodies_are_described(document: dict[str, Any]) -> None:
    for method, path, op in _operations(document):
        if op.get("security"):
            assert "401" in op["responses"], (method, path)
        if path.startswith("/v1/admin/"):
            assert op["security"] == [{"admin": []}] and "403" in op["responses"], (method, path)
        if method in ("post", "put", "patch") and (method, path) not in BODYLESS_WRITES:
            media = "multipart/form-data" if (method, path) in UPLOADS else "application/json"
            assert op["requestBody"]["content"][media]["schema"]["$ref"], (method, path)
            assert {"400", "499"} <= set(op["responses"]), (method, path)
    schemas = document["components"]["schemas"]
    assert {"model", "messages"} <= set(schemas["ChatCompletionRequest"]["required"])
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is True  # unknown fields pass through


def test_the_self_route_headers(document: dict[str, Any]) -> None:
    chat = document["paths"]["/v1/chat/completions"]["post"]
    headers = {p["name"] for p in chat["parameters"] if p["in"] == "header"}
    assert headers == {"X-Darkbloom-Route", "X-Darkbloom-Machine", "X-Darkbloom-Share"}
    assert set(chat["requestBody"]["content"]) == {"application/json", "application/darkbloom-sealed+json"}
    ok = chat["responses"]["200"]
    assert set(ok["headers"]) == {"X-Request-Id", "X-Provider-Id", "X-Darkbloom-Routed", "X-Darkbloom-Billing",
                                  "X-Darkbloom-Cost-Micro-USD"}
    assert set(ok["content"]) == {"application/json", "text/event-stream", "application/darkbloom-sealed+json"}
    assert {"402", "404", "409", "429", "502", "503", "504"} <= set(chat["responses"])
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    components = document["components"]["headers"]
    assert components["X-Darkbloom-Routed"]["schema"] == {"enum": ["owned", "shared", "fleet"]}
    assert components["X-Darkbloom-Billing"]["schema"] == {"enum": ["free", "charged"]}
    assert components["X-Darkbloom-Cost-Micro-USD"]["required"] is False  # streams say it in their usage event
    schemas = document["components"]["schemas"]
    assert "cost_micro_usd" in schemas["Usage"]["required"]
    for answer in ("Response", "Message", "EmbeddingList"):
        assert schemas[answer]["properties"]["usage"]["required"] == ["cost_micro_usd"], answer
    models = document["paths"]["/v1/models"]["get"]
    assert [p["name"] for p in models["parameters"] if p["in"] == "header"] == ["X-Darkbloom-Route"]


@pytest.mark.parametrize(("path", "allow"), [
    ("/v1/keys", "GET, OPTIONS, POST"),
    ("/v1/keys/key_x", "DELETE, GET, OPTIONS, PATCH"),
    ("/v1/admin/catalog", "GET, OPTIONS, PUT"),
    ("/v1/chat/completions", "OPTIONS, POST"),
    ("/v1/models/org/model", "GET, OPTIONS"),
])
async def test_options_names_every_method_of_the_path(client: httpx.AsyncClient, path: str, allow: str) -> None:
    response = await client.options(path)
    assert response.status_code == 204
    assert response.headers["allow"] == allow
    assert response.content == b""


async def test_a_wrong_method_gets_405_with_the_full_allow(client: httpx.AsyncClient) -> None:
    response = await client.delete("/v1/keys")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, OPTIONS, POST"
    assert response.json()["error"]["type"] == "method_not_allowed"
    jsonschema.validate(response.json(), ERROR_ENVELOPE)


async def test_options_on_an_unknown_path_is_404(client: httpx.AsyncClient) -> None:
    assert (await client.options("/v1/nothing-here")).status_code == 404
    assert (await client.options("/ws/provider")).status_code == 404  # a WebSocket, not an HTTP resource


async def test_with_cors_preflights_stay_cors_and_plain_options_gets_allow() -> None:
    app = create_app(CoordinatorSettings(cors_origins="https://app.example"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as client:
        preflight = await client.options("/v1/keys", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        plain = await client.options("/v1/keys", headers={"Origin": "https://app.example"})
        assert plain.status_code == 204
        assert plain.headers["allow"] == "GET, OPTIONS, POST"
        assert plain.headers["access-control-allow-origin"] == "https://app.example"
