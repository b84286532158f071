"""OPTIONS and 405 answers that name every method a path supports (RFC 9110 §9.3.7, §15.5.6).

The router answers a method a route does not take with 405 and an ``Allow`` naming that one
route's methods, although several routes may share the path (GET and POST /v1/keys). Here an
``OPTIONS`` request on any path the app serves gets 204 with the full ``Allow``; any other method
the path does not take gets the 405 envelope with the same ``Allow``. With ``--cors-origins``,
Starlette's CORS middleware (outermost) still answers real preflights before the router sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from darkbloom.wire.openai.handlers import http_error_handler


def http_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """Every route with its full path (FastAPI ≥ 0.16x keeps included routers nested)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI: app.routes is already flat
        yield from routes
        return
    yield from iter_route_contexts(list(routes))


def allowed_methods(app: Any, path: str) -> set[str]:
    """The methods of every HTTP route matching ``path`` (empty when none does)."""
    methods: set[str] = set()
    for route in http_routes(app.routes):
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods)
    return methods


def allow_header(methods: set[str]) -> str:
    return ", ".join(sorted(methods | {"OPTIONS"}))


def _route_path(request: Request) -> str:
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    methods = allowed_methods(request.app, _route_path(request))
    headers = dict(exc.headers or {})
    if methods:
        headers["Allow"] = allow_header(methods)
    if request.method == "OPTIONS":
        return Response(status_code=204, headers={"Allow": headers.get("Allow", "OPTIONS")})
    return await http_error_handler(request, HTTPException(405, exc.detail, headers=headers))


def install_allowed_methods(app: FastAPI) -> None:
    app.add_exception_handler(405, _method_not_allowed)
