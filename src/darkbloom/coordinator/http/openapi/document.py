"""The coordinator's OpenAPI document, served at GET /openapi.json.

FastAPI generates the paths and parameters from the routes; since the routes read their bodies
themselves (each with its ``BodySchema``, to keep their own messages and codes), this module adds
what the generator cannot see: each request body (the JSON Schema of the type that validates it),
every response with its status (errors with the OpenAI envelope), the Self-Route request headers,
the routing response headers and the security schemes. Each operation's part
comes from ``operations.OPERATIONS``; a route missing there is an error when the document
is built, so a new route cannot go undocumented.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.routing import Route

from darkbloom.coordinator.http.allowed_methods import http_routes
from darkbloom.coordinator.http.openapi.inference import INFERENCE_OPERATIONS, INFERENCE_SCHEMAS
from darkbloom.coordinator.http.openapi.operations import OPERATIONS, Operation, extra_schemas
from darkbloom.coordinator.http.openapi.schemas import SCHEMAS, Schema, ref
from darkbloom.wire.openai.errors import NOT_RETRYABLE

ERROR_MEANINGS = {
    400: "The request is invalid; fix it before retrying.",
    401: "Missing or invalid credentials.",
    402: "Payment required: the balance or the key's spend limit cannot cover the request.",
    403: "This credential may not do this.",
    404: "Not found.",
    409: "Conflicts with the current state.",
    410: "Expired.",
    413: "The request body is over the body limit (8 MiB by default).",
    429: "Too many requests, or every provider that could serve it is busy.",
    499: "The client went away before the answer (nobody receives it; it shows in logs and metrics).",
    502: "The provider failed to serve the request.",
    503: "Unavailable right now.",
    504: "The provider did not answer in time.",
}

def _header(description: str, schema: Schema | None = None, required: bool = False) -> dict[str, Any]:
    return {"description": description, "required": required, "schema": schema or {"type": "string"}}


HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": _header("The request's id (chatcmpl-…), also in its usage row.", required=True),
    "X-Provider-Id": _header("The provider session (prov_…) that served the request.", required=True),
    "X-Darkbloom-Routed": _header("`owned`: one of your own machines served it; `shared`: a machine shared with "
                                  "you; `fleet`: the public fleet.", {"enum": ["owned", "shared", "fleet"]},
                                  required=True),
    "X-Darkbloom-Billing": _header("`free` when your own machine served a self-routed request or a free share "
                                   "served it, else `charged`.",
                                   {"enum": ["free", "charged"]}, required=True),
    "X-Darkbloom-Cost-Micro-USD": _header("On a non-streamed answer: what the request was charged, in µUSD (0 when "
                                          "free) — its `usage.cost_micro_usd` and its usage row's. A stream says "
                                          "it in its usage event instead.", {"type": "string", "pattern": "^[0-9]+$"}),
    "x-should-retry": _header("`false`: a retry of this request cannot succeed.", {"const": "false"},
                              required=True),
    "Retry-After": _header("Seconds to wait before retrying.", {"type": "string", "pattern": "^[0-9]+$"}),
    "WWW-Authenticate": _header("`Bearer`: how to authenticate."),
}

REQUEST_HEADERS: dict[str, dict[str, Any]] = {
    "X-Darkbloom-Route": {
        "description": "Self-Route: `self` serves only on your own machines (free; exclusive), `prefer` uses "
                       "them when one can serve and the public fleet otherwise, `shared` your own machines and "
                       "those shared with you (never the fleet; docs/sharing.md). First value, trimmed, "
                       "case-insensitive; any other value is ignored. A self_route_only key is always exclusive, "
                       "a shared_only key always shared.",
        "schema": {"type": "string", "examples": ["self", "prefer", "shared"]}},
    "X-Darkbloom-Machine": {
        "description": "Pin an exclusive request to one of your machines (mach_… or prov_…). Sent without an "
                       "exclusive policy, twice, blank, with a comma or over 256 characters: 400 (param "
                       "X-Darkbloom-Machine); unknown or another account's: 404 machine_not_found.",
        "schema": {"type": "string"}},
    "X-Darkbloom-Share": {
        "description": "With shared routing, use only this share's machines (and your own). Sent without shared "
                       "routing, twice or blank: 400 (param X-Darkbloom-Share); a share not given to you: 404 "
                       "share_not_found; one you have not accepted: 409 share_not_accepted; one priced above "
                       "the key's max_shared_price: 403 share_price_above_key_ceiling.",
        "schema": {"type": "string", "examples": ["shr_0123456789abcdef"]}},
}

SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "A consumer API key (dk-…), a console session (dks-…) or a device token (dkp-…, "
                              "inference and account reads only)."},
    "admin": {"type": "http", "scheme": "bearer", "description": "The coordinator's --admin-token."},
}
_AUTH_ERRORS: dict[str, dict[int, tuple[str, ...]]] = {
    "caller": {401: ("invalid_api_key", "key_expired", "key_disabled")},
    "manager": {401: ("invalid_api_key", "key_expired", "key_disabled"),
                403: ("permission_denied", "key_restricted", "forbidden")},
    "admin": {401: ("invalid_api_key",), 403: ("permission_denied (the admin API is disabled)",)},
}


def install_openapi(app: FastAPI) -> None:
    """Serve the complete document at the app's openapi_url (GET /openapi.json)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="The Darkbloom coordinator: an OpenAI-compatible API with Self-Route "
                                       "(docs/api.md). Every error body is the OpenAI envelope "
                                       "`{\"error\": {message, type, code, param}}`; unless listed with its "
                                       "type, `code == type`.")
    paths: dict[str, dict[str, Any]] = document.setdefault("paths", {})
    if app.openapi_url:
        paths.setdefault(app.openapi_url, {})["get"] = {"operationId": "openapi_document"}
    for listed in http_routes(app.routes):  # plain Starlette routes (the inference ones): the generator skips them
        route = getattr(listed, "route", listed)  # newer FastAPI lists each route in a context
        if isinstance(route, Route) and not isinstance(route, APIRoute) and route.include_in_schema:
            for method in sorted((route.methods or set()) - {"HEAD"}):
                paths.setdefault(route.path, {})[method.lower()] = {
                    "operationId": re.sub(r"\W", "_", f"{route.name}{route.path}") + f"_{method.lower()}"}
    for path, item in paths.items():
        for method, operation in item.items():
            spec = OPERATIONS.get((method, path)) or INFERENCE_OPERATIONS.get((method, path))
            if spec is None:
                raise LookupError(f"{method.upper()} {path} has no entry in openapi.operations.OPERATIONS")
            _apply(operation, spec, path)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # the 422s are replaced by 400s
        schemas.pop(unused, None)
    schemas.update(copy.deepcopy(SCHEMAS))
    schemas.update(copy.deepcopy(INFERENCE_SCHEMAS))
    schemas.update(extra_schemas())
    components["headers"] = copy.deepcopy(HEADERS)
    components["securitySchemes"] = copy.deepcopy(SECURITY_SCHEMES)
    document["tags"] = [{"name": name} for name in
                        ("inference", "accounts", "keys", "payments", "device", "admin", "public", "console")]
    return document


def _apply(operation: dict[str, Any], spec: Operation, path: str) -> None:
    operation["tags"] = [spec.tag]
    operation["summary"] = spec.summary
    if spec.description:
        operation["description"] = spec.description
    parameters = [p for p in operation.get("parameters", []) if p.get("in") != "header"]
    for name in re.findall(r"{(\w+)}", path):
        if not any(p["in"] == "path" and p["name"] == name for p in parameters):
            parameters.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"}})
    parameters += [{"name": name, "in": "header", "required": False, **copy.deepcopy(REQUEST_HEADERS[name])}
                   for name in spec.route_headers]
    if parameters:
        operation["parameters"] = parameters
    if spec.body:
        content = {media: {"schema": ref(schema)} for media, schema in spec.body.items()}
        if spec.examples:
            content["application/json"]["examples"] = {name: {"value": copy.deepcopy(value)}
                                                       for name, value in spec.examples.items()}
        operation["requestBody"] = {"required": spec.body_required, "content": content}
    if spec.auth:
        operation["security"] = [{"admin" if spec.auth == "admin" else "bearer": []}]
    operation["responses"] = _responses(spec)


def _responses(spec: Operation) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, answer in spec.answers.items():
        response: dict[str, Any] = {"description": answer.description}
        if answer.content:
            response["content"] = {media: {"schema": ref(schema)} for media, schema in answer.content.items()}
        if answer.headers:
            response["headers"] = {name: {"$ref": f"#/components/headers/{name}"} for name in answer.headers}
        responses[str(status)] = response
    errors: dict[int, list[str]] = {}
    for status, codes in [*_AUTH_ERRORS.get(spec.auth or "", {}).items(), *spec.errors.items()]:
        listed = errors.setdefault(status, [])
        listed.extend(code for code in codes if code not in listed)
    if spec.body:  # malformed JSON, and the client going away while its body is read
        codes = errors.setdefault(400, [])
        if "invalid_request_error" not in codes:
            codes.insert(0, "invalid_request_error")
        errors[499] = ["client_disconnected"]
    errors[413] = ["request_too_large"]  # the body limit answers before any route
    for status in sorted(errors):
        responses[str(status)] = _error_response(status, errors[status], spec.error_schema)
    return responses


def _error_response(status: int, codes: list[str], schema: str) -> dict[str, Any]:
    listed = ", ".join(f"`{code}`" for code in codes)
    response: dict[str, Any] = {
        "description": f"{ERROR_MEANINGS[status]} `error.code`: {listed}.",
        "content": {"application/json": {"schema": ref(schema)}},
    }
    headers = {}
    if status in NOT_RETRYABLE:
        headers["x-should-retry"] = {"$ref": "#/components/headers/x-should-retry"}
    if status == 401:
        headers["WWW-Authenticate"] = {"$ref": "#/components/headers/WWW-Authenticate"}
    if status in (429, 503):
        headers["Retry-After"] = {"$ref": "#/components/headers/Retry-After"}
    if headers:
        response["headers"] = headers
    return response
