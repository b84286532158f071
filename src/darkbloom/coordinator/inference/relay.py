"""Dispatch a sealed request on a claimed slot and relay the provider's sealed chunks back.

Nothing is sent to the client before the first content chunk, so a failure before it is still a
plain HTTP error (and may be retried on another provider).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.pending import Chunk, Completed, Event, Failed, PendingRequest, UsageBounds
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.inference.calls import InferenceCall
from darkbloom.coordinator.inference.failures import ProviderFailure
from darkbloom.wire.openai.chunks import has_content
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.protocol import Cancel, InferenceRequest, dump


_YIELD_EVERY = 64  # events the relay takes from a full queue before it lets the loop run others
_FLUSH_PARTS = 256  # events' parts gathered before they go out, even with more chunks waiting


@dataclass(frozen=True)
class Deadlines:
    """After first content: at most ``idle`` seconds between provider events, and the whole request
    over by ``until`` (monotonic). A provider that misses either is stopped and the request fails."""

    idle: float
    until: float

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings, started: float) -> "Deadlines":
        return cls(idle=settings.idle_timeout, until=started + settings.request_timeout)


def dispatch(slot: Slot, call: InferenceCall, provider_model_id: str, request_id: str, max_tokens: int,
             bounds: UsageBounds | None = None) -> PendingRequest:
    """Send a sealed request on a claimed slot; the attempt holds the slot until ``release``."""
    session = slot.session
    pending = PendingRequest(request_id, slot, bounds, call.api)
    session.pending[request_id] = pending
    if not session.online:
        # It disconnected after the slot was claimed (close_session already failed what it had):
        # fail now so the caller retries elsewhere instead of waiting out the first-content budget.
        pending.on_provider_gone()
        return pending
    assert session.public_key is not None, "only sessions with an encryption key are routable"
    envelope = pending.reply_key.seal_request(call.for_provider(provider_model_id, max_tokens), session.public_key)
    frame = dump(InferenceRequest(request_id=request_id, encrypted_body=envelope, api=call.api))
    limit = session.registration.max_request_frame_bytes
    if len(frame) > limit:
        # never sent: a frame over the node's limit would close its socket and every stream on it
        pending.on_error(413, f"The sealed request is {len(frame)} bytes; this provider accepts at most {limit}.")
        return pending
    pending.sent = True
    session.send_request(pending, frame)  # another replica's session: over NATS to the replica holding it
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


async def _next_event(pending: PendingRequest, deadlines: Deadlines) -> Event:
    """The provider's next event, or — when it stays silent past a deadline, or floods past the
    request's — a timeout failure (the provider is told to stop)."""
    if not pending.events.empty():  # already here: no deadline to arm (the common case under load)
        pending.taken_since_yield += 1
        if pending.taken_since_yield < _YIELD_EVERY:
            return pending.events.get_nowait()
        pending.taken_since_yield = 0
        await asyncio.sleep(0)  # a provider that floods the queue never holds the loop
        if time.monotonic() >= deadlines.until:
            return _timed_out(pending, "did not finish within the request deadline")
        if not pending.events.empty():
            return pending.events.get_nowait()
    remaining = deadlines.until - time.monotonic()
    wait = min(deadlines.idle, remaining)
    try:
        async with asyncio.timeout(max(wait, 0.0)):
            return await pending.events.get()
    except TimeoutError:
        return _timed_out(pending, f"sent nothing for {deadlines.idle:g} s"
                          if wait == deadlines.idle and remaining > deadlines.idle
                          else "did not finish within the request deadline")


def _timed_out(pending: PendingRequest, why: str) -> Failed:
    failure = Failed(504, f"The provider {why}; the answer is incomplete.", "provider_timeout")
    if not pending.finished:
        pending.session.send(dump(Cancel(request_id=pending.request_id)))
    pending.finished, pending.failure = True, failure
    return failure


async def relay_chunks(pending: PendingRequest, completed: bool, presenter: Presenter,
                       deadlines: Deadlines) -> AsyncIterator[bytes]:
    """The presenter's events for the buffered head and every later chunk, until the provider
    finishes, fails or misses a deadline (then ``pending.usage`` or ``pending.failure`` says which).
    The events of the chunks already waiting go out together (up to _FLUSH_PARTS of them per write):
    a model making one token at a time gets one write per token, a burst (or a relay behind under
    load) far fewer; a long queue is drained with the loop let run every _YIELD_EVERY chunks."""
    parts = list(presenter.stream_start())
    for index, data in enumerate(pending.head):
        parts.extend(presenter.stream_chunk(data))
        if index % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    while not completed:
        if parts and (pending.events.empty() or len(parts) >= _FLUSH_PARTS):
            yield b"".join(parts)
            parts = []
        event = await _next_event(pending, deadlines)
        if isinstance(event, Chunk):
            parts.extend(presenter.stream_chunk(event.data))
        elif isinstance(event, Failed):
            pending.failure = event
            break
        else:
            completed = True
    if parts:
        yield b"".join(parts)


async def collect(pending: PendingRequest, completed: bool, presenter: Presenter,
                  deadlines: Deadlines) -> dict[str, Any]:
    """Assemble the non-streamed answer from the chunks."""
    for index, data in enumerate(pending.head):
        presenter.collect(data)
        if index % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    while not completed:
        event = await _next_event(pending, deadlines)
        if isinstance(event, Chunk):
            presenter.collect(event.data)
        elif isinstance(event, Failed):
            raise ProviderFailure(event)
        else:
            completed = True
    assert pending.usage is not None
    return presenter.response(pending.usage)
