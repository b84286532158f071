"""The node's backend in tests: `MockBackend(handler)`, a real `Backend` whose streams a handler
function writes (as httpx's `MockTransport(handler)` is a real transport), passed in where a node or
direct mode takes a backend (`ProviderNode(backend=…)`, `create_app(backend, …)`). The two test hooks
`tests.support.node_main` gives a real node process are built on it: `FirstTokenDelayBackend` and
`FailingBackend`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.backends.base import UsageMeter
from darkbloom.wire.protocol import Api

log = logging.getLogger(__name__)

Chunk = dict[str, Any]
Chunks = AsyncIterator[Chunk] | Iterable[Chunk]


@dataclass
class BackendCall:
    """One stream a backend was asked for. `meter` is the caller's (a fresh one when it gave none),
    for the handler to keep current as a backend does; `ended` is set once the stream finished,
    failed or was closed."""

    api: Api
    model_id: str
    body: dict[str, Any]
    meter: UsageMeter
    ended: asyncio.Event = field(default_factory=asyncio.Event)


Handler = Callable[[BackendCall], Chunks]


class MockBackend:
    """A backend whose every stream (`stream_chat`, `stream_completion`, `stream_embeddings`) is what
    `handler` returns for its `BackendCall`: an async generator (to wait, stall or fail part-way, and
    see itself closed in a `finally`) or a plain list of chunks. As with a real backend nothing runs
    until the stream is iterated; then the call is recorded in `calls` and the handler called. A
    `BackendError` the handler raises is the stream's; closing the stream early closes the handler's
    generator. `starts` and `closes` count the calls of `start()` and `close()`."""

    def __init__(self, handler: Handler, capabilities: frozenset[str] = frozenset()) -> None:
        self.handler = handler
        self._capabilities = capabilities
        self.calls: list[BackendCall] = []
        self.starts = 0
        self.closes = 0

    async def start(self) -> None:
        self.starts += 1

    async def close(self) -> None:
        self.closes += 1

    def capabilities(self, model_id: str) -> frozenset[str]:
        return self._capabilities

    def stream_chat(self, model_id: str, body: dict[str, Any],
                    meter: UsageMeter | None = None) -> AsyncIterator[Chunk]:
        return self._stream("chat", model_id, body, meter)

    def stream_completion(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[Chunk]:
        return self._stream("completions", model_id, body, meter)

    def stream_embeddings(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[Chunk]:
        return self._stream("embeddings", model_id, body, meter)

    async def _stream(self, api: Api, model_id: str, body: dict[str, Any],
                      meter: UsageMeter | None) -> AsyncGenerator[Chunk, None]:
        call = BackendCall(api, model_id, body, meter if meter is not None else UsageMeter())
        self.calls.append(call)
        try:
            chunks = self.handler(call)
            if not isinstance(chunks, AsyncIterator):
                for chunk in chunks:
                    yield chunk
                return
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                if isinstance(chunks, AsyncGenerator):
                    await chunks.aclose()  # the stream closed early: the handler's generator with it
        finally:
            call.ended.set()


class FirstTokenDelayBackend(MockBackend):
    """Wraps a backend: each `stream_chat` sleeps `delay` seconds before the inner stream starts, so a
    test knows the provider is "before first content" (to kill it, or to make the coordinator start
    its speculative backup). A `cancel` from the coordinator (or the node stopping) interrupts the
    wait at once: the request ends with no tokens used. Plain chat only, as its capabilities say."""

    def __init__(self, inner: Backend, delay: float) -> None:
        super().__init__(self._after_the_delay)
        self.inner = inner
        self.delay = delay

    async def start(self) -> None:
        log.warning("TEST HOOK ON: every request's first token is delayed by %g s", self.delay)
        await super().start()
        await self.inner.start()

    async def close(self) -> None:
        await super().close()
        await self.inner.close()

    async def _after_the_delay(self, call: BackendCall) -> AsyncIterator[Chunk]:
        if call.api != "chat":
            raise BackendError(400, f"this node does not serve the {call.api} API", param="model")
        await asyncio.sleep(self.delay)  # a cancel raises CancelledError here: nothing was generated
        stream = self.inner.stream_chat(call.model_id, call.body, call.meter)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # closing the wrapper early stops the inner generation too


class FailingBackend(MockBackend):
    """Answers every request with HTTP `status` and runs no model: given to a node as its direct-mode
    backend, it shows that the direct-first client returns a local error as the answer instead of
    falling back to the coordinator (which the node still serves with its real backend)."""

    def __init__(self, status: int) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"a failing backend answers an HTTP error status (400-599), not {status}")
        super().__init__(self._fail)
        self.status = status

    async def start(self) -> None:
        log.warning("TEST HOOK ON: direct mode answers %d to every request", self.status)
        await super().start()

    def _fail(self, call: BackendCall) -> NoReturn:
        raise BackendError(self.status, f"test hook: direct mode answers {self.status} to every request")
