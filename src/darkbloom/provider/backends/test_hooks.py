"""TEST HOOKS ONLY — never use these in production. Every hook is off unless its variable is set.

`DARKBLOOM_TEST_FIRST_TOKEN_DELAY=<seconds>` (read by `provider.config.load_config` into
`ProviderConfig.test_first_token_delay`): the node waits this long before it starts each request's
generation, so its first streamed token comes that much later. End-to-end tests use it to make a
provider surely "before first content" while they kill it, or slow enough that the coordinator's
speculative backup starts. A `cancel` from the coordinator (or the node shutting down) interrupts
the wait at once: the request ends with no tokens used. The node logs a warning at start while the
hook is on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from darkbloom.provider.backends.base import Backend, UsageMeter

log = logging.getLogger(__name__)

FIRST_TOKEN_DELAY_ENV = "DARKBLOOM_TEST_FIRST_TOKEN_DELAY"


def parse_first_token_delay(value: str | None) -> float:
    """Seconds from the variable's text; unset or empty is 0 (off). ValueError when not a number ≥ 0."""
    if value is None or not value.strip():
        return 0.0
    try:
        delay = float(value)
    except ValueError:
        raise ValueError(f"{FIRST_TOKEN_DELAY_ENV} must be a number of seconds, not {value!r}") from None
    if not delay >= 0 or delay == float("inf"):  # also rejects NaN
        raise ValueError(f"{FIRST_TOKEN_DELAY_ENV} must be a finite number of seconds ≥ 0, not {value!r}")
    return delay


class FirstTokenDelayBackend:
    """Wraps a backend: each `stream_chat` sleeps `delay` seconds before the inner stream starts."""

    def __init__(self, inner: Backend, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    async def start(self) -> None:
        log.warning("TEST HOOK ON: every request's first token is delayed by %g s (%s)", self.delay,
                    FIRST_TOKEN_DELAY_ENV)
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

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


def with_test_hooks(backend: Backend, first_token_delay: float) -> Backend:
    """The backend, wrapped by every hook that is on (none by default)."""
    if first_token_delay > 0:
        return FirstTokenDelayBackend(backend, first_token_delay)
    return backend
