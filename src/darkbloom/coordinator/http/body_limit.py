"""Reject request bodies over the limit (413 request_too_large, in the path's API's envelope) before
anything reads them whole."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from darkbloom.wire.openai.body import request_too_large
from darkbloom.wire.openai.handlers import path_error_response


class _TooLarge(Exception):
    pass


UPLOAD_FRAMING = 64 * 1024  # a multipart upload's boundaries, headers and small fields beside its file


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, uploads: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.uploads = uploads or {}  # a POST path → its own limit (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.uploads.get(scope["path"], self.max_bytes) if scope["method"] == "POST" else self.max_bytes
        declared, chunked = _framing(scope["headers"])
        if declared is not None and not chunked:
            # The HTTP parser delivers exactly Content-Length bytes, so a declared length within
            # the limit needs no counting on the way in (the common case: every SDK declares it).
            if declared > limit:
                await _reject(scope, receive, send, limit)
            else:
                await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send, limit)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _reject(scope, receive, send, limit)


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(declared Content-Length if it is a plain number, whether Transfer-Encoding is present)."""
    declared, chunked = None, False
    for name, value in headers:
        if name == b"content-length":
            declared = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            chunked = True
    return declared, chunked


async def _reject(scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
    await path_error_response(scope["path"], request_too_large(max_bytes))(scope, receive, send)
