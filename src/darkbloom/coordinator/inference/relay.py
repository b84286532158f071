"""Dispatch a sealed request on a claimed slot and relay the provider's sealed chunks back.

Nothing is sent to the client before the first content chunk, so a failure before it is still a
plain HTTP error (and may be retried on another provider).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from darkbloom.coordinator.fleet.pending import Chunk, Completed, Failed, PendingRequest
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.inference.chat_request import ChatRequest
from darkbloom.wire.openai.chunks import MessageBuilder, has_content, sse
from darkbloom.wire.openai.errors import ApiError, error_body
from darkbloom.wire.openai.shaping import ChunkShaper
from darkbloom.wire.protocol import Cancel, InferenceRequest, dump


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


def dispatch(slot: Slot, chat: ChatRequest, provider_model_id: str, request_id: str,
             max_tokens: int) -> PendingRequest:
    """Send a sealed request on a claimed slot; the attempt holds the slot until ``release``."""
    session = slot.session
    pending = PendingRequest(request_id, slot)
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
    if pending.session.pending.get(pending.request_id) is pending:
        del pending.session.pending[pending.request_id]
    pending.slot.release()


def abandon(pending: PendingRequest) -> None:
    """Drop an attempt that lost or failed: tell the provider to stop, free the slot. Idempotent."""
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
    return shaper.completion(message, pending.usage)
