"""Test doubles for the node's backend: real `Backend` implementations a test passes in
(`ProviderNode(backend=…, direct_backend=…)`, or `tests.support.node_main` for a node process)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from darkbloom.provider.backends import Backend, BackendError
from darkbloom.provider.backends.base import UsageMeter

log = logging.getLogger(__name__)


class FirstTokenDelayBackend:
    """Wraps a backend: each `stream_chat` sleeps `delay` seconds before the inner stream starts, so a
    test knows the provider is "before first content" (to kill it, or to make the coordinator start
    its speculative backup). A `cancel` from the coordinator (or the node stopping) interrupts the
    wait at once: the request ends with no tokens used."""

    def __init__(self, inner: Backend, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    async def start(self) -> None:
        log.warning("TEST HOOK ON: every request's first token is delayed by %g s", self.delay)
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def capabilities(self, model_id: str) -> frozenset[str]:
        return frozenset()  # plain chat: the wrapper serves `stream_chat` alone

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(self.delay)  # a cancel raises CancelledError here: nothing was generated
        stream = self.inner.stream_chat(model_id, body, meter)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # closing the wrapper early stops the inner generation too


class FailingBackend:
    """Answers every chat completion with HTTP `status` and runs no model: given to a node as its
    direct-mode backend, it shows that the direct-first client returns a local error as the answer
    instead of falling back to the coordinator (which the node still serves with its real backend)."""

    def __init__(self, status: int) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"a failing backend answers an HTTP error status (400-599), not {status}")
        self.status = status
        self.calls = 0

    async def start(self) -> None:
        log.warning("TEST HOOK ON: direct mode answers %d to every chat completion", self.status)

    async def close(self) -> None:
        pass

    def capabilities(self, model_id: str) -> frozenset[str]:
        return frozenset()

    async def stream_chat(self, model_id: str, body: dict[str, Any],
                          meter: UsageMeter | None = None) -> AsyncIterator[dict[str, Any]]:
        self.calls += 1
        raise BackendError(self.status, f"test hook: direct mode answers {self.status} to every chat completion")
        yield {}  # pragma: no cover - makes this an async generator, like every backend's stream
