"""One attempt of one request on one provider session, as the socket reader and the relay share it.

The provider socket reader pushes events in (``on_chunk``, ``on_complete``, ``on_error``,
``on_provider_gone``); the relay pulls them out of ``events``. The attempt holds the session's
slot until the relay releases it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Union

from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire.crypto import DecryptionError, ReplyKey
from darkbloom.wire.openai.chunk_shapes import chunk_problem
from darkbloom.wire.protocol import Api, Envelope, Usage

log = logging.getLogger("darkbloom.relay")


@dataclass(frozen=True)
class Chunk:
    data: dict[str, Any]


@dataclass(frozen=True)
class Completed:
    usage: Usage


@dataclass(frozen=True)
class Failed:
    status: int
    message: str  # always the coordinator's own sentence, never the provider's text
    reason: str  # provider_error | provider_unavailable | provider_timeout | untrusted_chunk | untrusted_usage
    param: str | None = None  # for a request the provider refused: which parameter
    code: str | None = None   # and why, from PROVIDER_ERROR_CODES (or FRAME_TOO_LARGE, the coordinator's own)


Event = Union[Chunk, Completed, Failed]
FRAME_TOO_LARGE = "frame_too_large"  # the code of a failure the coordinator gives a frame it refused as too large
_PROVIDER_FAILED = "The provider failed to serve the request."


@dataclass(frozen=True)
class UsageBounds:
    """The most a provider can truthfully report for a request: the prompt's proven upper bound
    and the ``max_tokens`` it was sent (reservations are sized from the same two: docs/billing.md
    "1. Admission: the reservation")."""

    prompt_tokens: int
    completion_tokens: int

    def exceeded_by(self, usage: Usage) -> bool:
        return usage.prompt_tokens > self.prompt_tokens or usage.completion_tokens > self.completion_tokens


class PendingRequest:
    def __init__(self, request_id: str, slot: Slot, bounds: UsageBounds | None = None, api: Api = "chat") -> None:
        self.request_id = request_id
        self.api = api
        self.bounds = bounds
        self.slot = slot
        self.session = slot.session
        registration = self.session.registration
        proven = registration.authenticated_chunks or self.session.remote  # a chunk across NATS always is
        self.reply_key = ReplyKey(registration.public_key if proven else None)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self.usage: Usage | None = None
        self.failure: Failed | None = None
        self.head: list[dict[str, Any]] = []  # chunks received before the first content
        self.first_content_at: float | None = None
        self.sent = False  # the request went out to the provider (a session that then vanishes took it along)
        self.taken_since_yield = 0  # events the relay took without letting the loop run others

    # called by the provider socket reader

    def on_chunk(self, envelope: Envelope) -> bool:
        """Open a sealed chunk — one OpenAI chunk object, or a non-empty array of them that the node
        sent together, each of the shape its API reads; False when it does not open (the caller
        distrusts the provider)."""
        try:
            chunks = response_chunks(self.reply_key.open(envelope))
        except (DecryptionError, ValueError) as exc:
            return self._unopened(f"does not open: {exc}")
        for chunk in chunks:
            problem = chunk_problem(chunk, self.api)
            if problem is not None:
                return self._unopened(f"is malformed: {problem}")
        for chunk in chunks:
            self.events.put_nowait(Chunk(chunk))
        return True

    def on_complete(self, usage: Usage) -> bool:
        """Record the provider's usage; False when it reports more than the request could have used
        (the request fails unbilled and the caller distrusts the provider)."""
        if self.bounds is not None and self.bounds.exceeded_by(usage):
            log.warning("request %s: %s reported %d prompt + %d completion tokens, above the request's bounds "
                        "%d + %d", self.request_id, self.session.id, usage.prompt_tokens, usage.completion_tokens,
                        self.bounds.prompt_tokens, self.bounds.completion_tokens)
            self._finish(Failed(502, "The provider reported impossible token usage for this request.",
                                "untrusted_usage"))
            return False
        self.usage = usage
        self._finish(Completed(usage))
        return True

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """The provider failed the request; its ``message`` is not kept (it never reaches a consumer)."""
        self._finish(Failed(status, _PROVIDER_FAILED, "provider_error", param, code))

    def on_provider_gone(self) -> None:
        self._finish(Failed(502, "The provider disconnected before finishing the request.",
                            "provider_unavailable"))

    def _unopened(self, why: str) -> bool:
        log.warning("request %s: a chunk from %s %s", self.request_id, self.session.id, why)
        self._finish(Failed(502, "The provider sent a response chunk that does not open (it failed decryption "
                                 "or is not a valid chunk).", "untrusted_chunk"))
        return False

    def _finish(self, event: Event) -> None:
        if not self.finished:
            self.finished = True
            self.events.put_nowait(event)
            if isinstance(event, Failed):
                self.failure = event
