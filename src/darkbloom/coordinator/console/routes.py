"""The web console (docs/console.md "Pages"): server-rendered page shells; the pages' scripts talk to the
coordinator only through the public HTTP API with the console session token."""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from darkbloom.wire.openai.errors import not_found

CONSOLE_DIR = Path(__file__).resolve().parent
STATIC_DIR = CONSOLE_DIR / "static"

# Every script is a same-origin module file and model output only ever reaches the page as text,
# so the policy can forbid inline scripts and styles outright.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

router = APIRouter(tags=["console"])  # in the OpenAPI document (schemathesis skips the HTML pages)
templates = Jinja2Templates(directory=str(CONSOLE_DIR / "templates"))


@dataclass(frozen=True)
class _Page:
    template: str
    title: str
    script: str | None
    signed_in: bool = True


PAGES = {
    "": _Page("chat.html", "Chat", "chat.js"),
    "keys": _Page("keys.html", "API keys", "keys.js"),
    "machines": _Page("machines.html", "Machines", "machines.js"),
    "sharing": _Page("sharing.html", "Sharing", "sharing.js"),
    "batches": _Page("batches.html", "Batches", "batches.js"),
    "usage": _Page("usage.html", "Usage & billing", "usage.js"),
    "link": _Page("link.html", "Link a machine", "link.js"),
    "login": _Page("auth.html", "Log in", "auth.js", signed_in=False),
    "signup": _Page("auth.html", "Sign up", "auth.js", signed_in=False),
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


def _load_assets() -> dict[str, _Asset]:
    assets = {}
    for path in sorted(STATIC_DIR.iterdir()):
        if path.is_file():
            body = path.read_bytes()
            media_type = "text/javascript" if path.suffix == ".js" else (
                mimetypes.guess_type(path.name)[0] or "application/octet-stream")
            assets[path.name] = _Asset(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return assets


_ASSETS = _load_assets()
_VERSION = hashlib.sha256(b"".join(a.etag.encode() for a in _ASSETS.values())).hexdigest()[:12]


def _coordinator_url(request: Request) -> str:
    """--public-url, else the address the coordinator listens on: never the request's Host header."""
    return str(request.app.state.services.settings.base_url).rstrip("/")


@router.get("/console")
async def console_root() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=308)


@router.get("/console/static/{name}")
async def static_file(name: str, request: Request) -> Response:
    asset = _ASSETS.get(name)
    if asset is None:
        raise not_found("not_found", f"No console file '{name}'.")
    headers = {"ETag": asset.etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


@router.get("/console/{page}")
@router.get("/console/", name="console_home")
async def console_page(request: Request, page: str = "") -> Response:
    spec = PAGES.get(page.strip("/"))
    if spec is None:
        raise not_found("not_found", f"No console page '{page}'.")
    context = {"page": page.strip("/") or "chat", "title": spec.title, "script": spec.script,
               "signed_in": spec.signed_in, "version": _VERSION, "coordinator_url": _coordinator_url(request)}
    return templates.TemplateResponse(request, spec.template, context, headers=SECURITY_HEADERS)
