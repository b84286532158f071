"""Dispatch a sealed request to a provider session and relay its sealed chunks back.

A ``PendingRequest`` is the coordinator's side of one attempt on one session: the provider
socket reader pushes events into it, the HTTP side pulls them out. Nothing is sent to the
client before the first content chunk, so a failure before it is still a plain HTTP error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Union

from darkbloom.coordinator.chat_request import ChatRequest
from darkbloom.coordinator.errors import ApiError, error_body
from darkbloom.coordinator.registry import ProviderSession
from darkbloom.crypto import DecryptionError, ReplyKey
from darkbloom.openai_chunks import MessageBuilder, has_content, sse
from darkbloom.protocol import Cancel, Envelope, InferenceRequest, Usage, dump

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
    message: str
    reason: str  # provider_error | provider_unavailable | provider_timeout | untrusted_chunk


Event = Union[Chunk, Completed, Failed]


class ProviderFailure(Exception):
    """An attempt failed before anything reached the client."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(failure.message)
        self.failure = failure

    def as_api_error(self) -> ApiError:
        failure = self.failure
        if 400 <= failure.status < 500 and failure.status != 429 and failure.reason == "provider_error":
            return ApiError(failure.status, "invalid_request_error", failure.message)
        if failure.reason == "provider_timeout":
            return ApiError(504, "provider_timeout", failure.message)
        return ApiError(502, failure.reason, failure.message)


class PendingRequest:
    def __init__(self, request_id: str, session: ProviderSession) -> None:
        self.request_id = request_id
        self.session = session
        self.reply_key = ReplyKey()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self.usage: Usage | None = None
        self.failure: Failed | None = None
        self.head: list[dict[str, Any]] = []  # chunks received before the first content
        self.first_content_at: float | None = None

    # called by the provider socket reader

    def on_chunk(self, envelope: Envelope) -> bool:
        """Open a sealed chunk; False when it does not open (the caller distrusts the provider)."""
        try:
            data = json.loads(self.reply_key.open(envelope))
            if not isinstance(data, dict):
                raise ValueError("chunk is not a JSON object")
        except (DecryptionError, ValueError) as exc:
            log.warning("request %s: chunk from %s does not open: %s", self.request_id, self.session.id, exc)
            self._finish(Failed(502, "The provider sent a response chunk that failed decryption.",
                                "untrusted_chunk"))
            return False
        self.events.put_nowait(Chunk(data))
        return True

    def on_complete(self, usage: Usage) -> None:
        self.usage = usage
        self._finish(Completed(usage))

    def on_error(self, status: int, message: str) -> None:
        self._finish(Failed(status, message or "The provider failed to serve the request.", "provider_error"))

    def on_provider_gone(self) -> None:
        self._finish(Failed(502, "The provider disconnected before finishing the request.",
                            "provider_unavailable"))

    def _finish(self, event: Event) -> None:
        if not self.finished:
            self.finished = True
            self.events.put_nowait(event)
            if isinstance(event, Failed):
                self.failure = event


def dispatch(session: ProviderSession, chat: ChatRequest, provider_model_id: str, request_id: str,
             max_tokens: int) -> PendingRequest:
    """Send a sealed request on a session whose slot the scheduler already claimed."""
    pending = PendingRequest(request_id, session)
    session.pending[request_id] = pending
    if not session.online:
        # It disconnected after the slot was claimed (close_session already failed what it had):
        # fail now so the caller retries elsewhere instead of waiting out the first-content budget.
        pending.on_provider_gone()
        return pending
    assert session.public_key is not None, "only sessions with an encryption key are routable"
    envelope = pending.reply_key.seal_request(chat.for_provider(provider_model_id, max_tokens), session.public_key)
    session.send(dump(InferenceRequest(request_id=request_id, encrypted_body=envelope)))
    return pending


async def stop(pending: PendingRequest, grace: float) -> None:
    """Ask the provider to stop and wait up to ``grace`` seconds for its final usage report."""
    if pending.finished:
        return
    pending.session.send(dump(Cancel(request_id=pending.request_id)))
    deadline = time.monotonic() + grace
    while not pending.finished and (remaining := deadline - time.monotonic()) > 0:
        try:
            event = await asyncio.wait_for(pending.events.get(), timeout=remaining)
        except TimeoutError:
            break
        if isinstance(event, Failed):
            pending.failure = event


def release(pending: PendingRequest) -> None:
    """Free the session's slot; frames arriving later for this request are ignored."""
    pending.finished = True
    if pending.session.pending.pop(pending.request_id, None) is not None:
        pending.session.active -= 1


def abandon(pending: PendingRequest) -> None:
    """Drop an attempt that lost or failed: tell the provider to stop, free the slot."""
    if not pending.finished:
        pending.session.send(dump(Cancel(request_id=pending.request_id)))
    release(pending)


async def first_content(pending: PendingRequest, deadline: float) -> bool:
    """Wait (until ``deadline``, monotonic) for the first content chunk or the completion; chunks
    before it accumulate on ``pending.head``. Returns whether the provider already completed.
    Raises ProviderFailure, or TimeoutError at the deadline with nothing lost (callers may wait again)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that races with
        # an arriving event, and the caller (client gone, race lost) would go on retrying
        async with asyncio.timeout(remaining):
            event = await pending.events.get()
        if isinstance(event, Failed):
            raise ProviderFailure(event)
        if isinstance(event, Completed):
            return True
        pending.head.append(event.data)
        if has_content(event.data):
            pending.first_content_at = time.monotonic()
            return False


def timed_out(budget: float) -> ProviderFailure:
    return ProviderFailure(Failed(504, f"The provider produced no output within {budget:g} s.", "provider_timeout"))


class ChunkShaper:
    """Rewrites provider chunks into the caller's view: our completion id, the model they asked for."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def chunk(self, data: dict[str, Any]) -> dict[str, Any]:
        data["id"] = self.request_id
        data["model"] = self.model
        data["object"] = "chat.completion.chunk"
        data.setdefault("created", self.created)
        return data

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": usage_dict(usage)}


def usage_dict(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}




async def relay_chunks(pending: PendingRequest, completed: bool, shaper: ChunkShaper) -> AsyncIterator[bytes]:
    """SSE lines for the buffered head and every later chunk, until the provider finishes or fails
    (then ``pending.usage`` or ``pending.failure`` says which)."""
    for data in pending.head:
        yield sse(shaper.chunk(data))
    while not completed:
        event = await pending.events.get()
        if isinstance(event, Chunk):
            yield sse(shaper.chunk(event.data))
        elif isinstance(event, Failed):
            pending.failure = event
            return
        else:
            completed = True


def failure_event(failure: Failed) -> bytes:
    return sse(error_body("provider_error", failure.message, code=failure.reason))


async def collect(pending: PendingRequest, completed: bool, shaper: ChunkShaper) -> dict[str, Any]:
    """Assemble a non-streaming chat.completion from the chunks."""
    message = MessageBuilder()
    for data in pending.head:
        message.add(data)
    while not completed:
        event = await pending.events.get()
        if isinstance(event, Chunk):
            message.add(event.data)
        elif isinstance(event, Failed):
            raise ProviderFailure(event)
        else:
            completed = True
    assert pending.usage is not None
    return {"id": shaper.request_id, "object": "chat.completion", "created": shaper.created,
            "model": shaper.model, "choices": [message.choice()], "usage": usage_dict(pending.usage)}
