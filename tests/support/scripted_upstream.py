"""A scripted OpenAI-compatible upstream for the node's `openai` backend: a real HTTP server on
127.0.0.1 (aiohttp, as the backend's client is) that answers every request with
``handler(request)``, written with httpx's request and response types as ``httpx.MockTransport``
takes them. A streamed body (``httpx.AsyncByteStream``) goes out part by part as it comes, and is
closed when the client goes away (the server cancels the handler then)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Awaitable, Callable

import httpx
from aiohttp import web

Handler = Callable[[httpx.Request], httpx.Response]
Scripted = Callable[[Handler], Awaitable[str]]  # the `scripted` fixture of tests/provider/conftest.py
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


@contextlib.asynccontextmanager
async def scripted_upstream(handler: Handler) -> AsyncIterator[str]:
    """The upstream's base URL while it runs."""

    async def serve(request: web.Request) -> web.StreamResponse:
        asked = httpx.Request(request.method, str(request.url), headers=dict(request.headers),
                              content=await request.read())
        answer = handler(asked)
        response = web.StreamResponse(status=answer.status_code, headers={
            name: value for name, value in answer.headers.items() if name.lower() not in _HOP_BY_HOP})
        await response.prepare(request)
        stream = answer.stream
        try:
            if isinstance(stream, httpx.ByteStream):
                await response.write(answer.content)
            else:
                assert isinstance(stream, httpx.AsyncByteStream)
                async for part in stream:
                    await response.write(part)
        finally:
            if isinstance(stream, httpx.AsyncByteStream):
                await stream.aclose()
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", serve)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
