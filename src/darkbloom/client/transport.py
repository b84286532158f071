"""The direct-first rule (docs/direct-mode.md "The direct-first client") as an httpx transport.

Every request goes to the local endpoint first (its token replaces the caller's Authorization).
Whatever HTTP response comes back is the answer, errors included. Only when no connection could be
made (refused, unreachable, DNS, connect timeout) does the same request go to the coordinator, with
the coordinator key and `X-Darkbloom-Route: self`. The response says which path served in
`X-Darkbloom-Via: local|coordinator`.

Requests are re-targeted by path: the part from `/v1` on is put after the chosen endpoint's root,
so the client's own base URL only has to end in `/v1` (the helpers use the coordinator's).
"""

from __future__ import annotations

import logging
from pathlib import Path
import httpx

from darkbloom.client.endpoints import Endpoint, discover_local_endpoint

log = logging.getLogger(__name__)

VIA_HEADER = "X-Darkbloom-Via"
ROUTE_HEADER = "X-Darkbloom-Route"
LOCAL_CONNECT_TIMEOUT = 3.0

# The connection-level failures that mean "the local endpoint is not there": nothing was sent.
FALLBACK_ERRORS: tuple[type[httpx.TransportError], ...] = (httpx.ConnectError, httpx.ConnectTimeout)


class _Router:
    """Which endpoint, and the request re-targeted to it. Shared by the sync and async transports."""

    def __init__(self, coordinator_url: str | None, api_key: str | None, local: Endpoint | None,
                 discover: bool, home: Path | None, local_connect_timeout: float) -> None:
        self.coordinator = Endpoint(coordinator_url, api_key or "") if coordinator_url else None
        self._local = local
        self._discover = discover and local is None
        self._home = home
        self.local_connect_timeout = local_connect_timeout

    def local(self) -> Endpoint | None:
        """The explicit local endpoint, or the one `local.json` names right now."""
        if self._local is not None:
            return self._local
        return discover_local_endpoint(self._home) if self._discover else None

    def to_local(self, request: httpx.Request, local: Endpoint) -> httpx.Request:
        timeout = dict(request.extensions.get("timeout") or {})
        connect = timeout.get("connect")
        timeout["connect"] = self.local_connect_timeout if connect is None else min(connect,
                                                                                     self.local_connect_timeout)
        return _retarget(request, local, {}, {**request.extensions, "timeout": timeout})

    def to_coordinator(self, request: httpx.Request) -> httpx.Request:
        assert self.coordinator is not None
        return _retarget(request, self.coordinator, {ROUTE_HEADER: "self"}, dict(request.extensions))

    def no_coordinator(self, exc: httpx.TransportError, local: Endpoint | None) -> httpx.ConnectError:
        where = f"the local endpoint {local.base_url} is unreachable ({exc})" if local else \
            "no local endpoint is configured or discovered (no live $DARKBLOOM_HOME/local.json)"
        return httpx.ConnectError(f"{where}, and no coordinator is configured to fall back to")


def _retarget(request: httpx.Request, endpoint: Endpoint, extra_headers: dict[str, str],
              extensions: dict[str, object]) -> httpx.Request:
    path = request.url.raw_path.decode("ascii")
    index = _v1_index(path)
    suffix = path[index:] if index >= 0 else path
    url = httpx.URL(endpoint.root + suffix)
    headers = httpx.Headers(request.headers)
    headers["Host"] = url.netloc.decode("ascii")
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    else:
        headers.pop("Authorization", None)
    if ROUTE_HEADER not in extra_headers:
        headers.pop(ROUTE_HEADER, None)
    headers.update(extra_headers)
    return httpx.Request(request.method, url, headers=headers, content=request.content, extensions=extensions)


def _v1_index(path: str) -> int:
    """Where the `/v1` segment starts in a path (with its query), or -1."""
    path_only = path.split("?", 1)[0]
    start = 0
    while (index := path_only.find("/v1", start)) >= 0:
        end = index + 3
        if end == len(path_only) or path_only[end] == "/":
            return index
        start = end
    return -1


def _mark(response: httpx.Response, via: str) -> httpx.Response:
    response.headers[VIA_HEADER] = via
    return response


class DirectFirstTransport(httpx.BaseTransport):
    """For `httpx.Client(transport=...)` and so `OpenAI(http_client=...)`.

    `local_url`/`local_token` name the local endpoint; without them (and with `discover`) it is read
    from `$DARKBLOOM_HOME/local.json` (or `home`) on every request, so a node started later is used.
    `coordinator_url`/`api_key`: where to fall back; without them a local failure is raised.
    """

    def __init__(self, coordinator_url: str | None = None, api_key: str | None = None, *,
                 local_url: str | None = None, local_token: str | None = None, discover: bool = True,
                 home: Path | None = None, transport: httpx.BaseTransport | None = None,
                 local_connect_timeout: float = LOCAL_CONNECT_TIMEOUT) -> None:
        self._router = _Router(coordinator_url, api_key, _explicit(local_url, local_token), discover, home,
                               local_connect_timeout)
        self._inner = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()  # the body may have to be sent twice
        local = self._router.local()
        if local is not None:
            try:
                return _mark(self._inner.handle_request(self._router.to_local(request, local)), "local")
            except FALLBACK_ERRORS as exc:
                if self._router.coordinator is None:
                    raise self._router.no_coordinator(exc, local) from exc
                log.info("local endpoint %s unreachable (%s); falling back to the coordinator", local.base_url, exc)
        elif self._router.coordinator is None:
            raise self._router.no_coordinator(httpx.ConnectError("none"), None)
        return _mark(self._inner.handle_request(self._router.to_coordinator(request)), "coordinator")

    def close(self) -> None:
        self._inner.close()


class AsyncDirectFirstTransport(httpx.AsyncBaseTransport):
    """The same rule for `httpx.AsyncClient(transport=...)` and so `AsyncOpenAI(http_client=...)`."""

    def __init__(self, coordinator_url: str | None = None, api_key: str | None = None, *,
                 local_url: str | None = None, local_token: str | None = None, discover: bool = True,
                 home: Path | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 local_connect_timeout: float = LOCAL_CONNECT_TIMEOUT) -> None:
        self._router = _Router(coordinator_url, api_key, _explicit(local_url, local_token), discover, home,
                               local_connect_timeout)
        self._inner = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        local = self._router.local()
        if local is not None:
            try:
                return _mark(await self._inner.handle_async_request(self._router.to_local(request, local)), "local")
            except FALLBACK_ERRORS as exc:
                if self._router.coordinator is None:
                    raise self._router.no_coordinator(exc, local) from exc
                log.info("local endpoint %s unreachable (%s); falling back to the coordinator", local.base_url, exc)
        elif self._router.coordinator is None:
            raise self._router.no_coordinator(httpx.ConnectError("none"), None)
        return _mark(await self._inner.handle_async_request(self._router.to_coordinator(request)), "coordinator")

    async def aclose(self) -> None:
        await self._inner.aclose()


def _explicit(local_url: str | None, local_token: str | None) -> Endpoint | None:
    if local_url is None:
        return None
    if not local_token:
        raise ValueError("local_url needs local_token: the dk-local-… token from the node's "
                         "$DARKBLOOM_HOME/local_token")
    return Endpoint(local_url, local_token)
