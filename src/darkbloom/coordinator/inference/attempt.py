"""One attempt of a request on one provider session: sent on a claimed slot, fed by the session,
read by the relay.

``dispatch`` seals the request to the provider's key, opens the attempt's inbox on the session and
sends the request through the session's link. The session delivers the node's frames to that inbox
(``on_chunk``, ``on_complete``, ``on_error``, ``on_provider_gone``: whether they came from this
replica's socket or from the replica holding the session), which queues them as events; the relay
takes them out (``first_content``, then ``relay`` for a stream or ``collect`` for a JSON answer).
The attempt holds the slot until ``release``.

Nothing is sent to the client before the first content chunk, so a failure before it is still a
plain HTTP error (and may be retried on another provider).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Union

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.inference.calls import InferenceCall
from darkbloom.coordinator.inference.failures import Failed, ProviderFailure
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire.crypto import DecryptionError
from darkbloom.wire.openai.chunk_shapes import chunk_problem
from darkbloom.wire.openai.chunks import has_content
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.protocol import Api, Envelope, InferenceRequest, Usage, dump

log = logging.getLogger("darkbloom.relay")
_YIELD_EVERY = 64  # events the relay takes from a full queue before it lets the loop run others
_FLUSH_PARTS = 256  # events' parts gathered before they go out, even with more chunks waiting
_PROVIDER_FAILED = "The provider failed to serve the request."


@dataclass(frozen=True)
class Chunk:
    data: dict[str, Any]


@dataclass(frozen=True)
class Completed:
    usage: Usage


Event = Union[Chunk, Completed, Failed]


@dataclass(frozen=True)
class UsageBounds:
    """The most a provider can truthfully report for a request: the prompt's proven upper bound
    and the ``max_tokens`` it was sent (reservations are sized from the same two: docs/billing.md
    "1. Admission: the reservation")."""

    prompt_tokens: int
    completion_tokens: int

    def exceeded_by(self, usage: Usage) -> bool:
        return usage.prompt_tokens > self.prompt_tokens or usage.completion_tokens > self.completion_tokens


@dataclass(frozen=True)
class Deadlines:
    """After first content: at most ``idle`` seconds between provider events, and the whole request
    over by ``until`` (monotonic). A provider that misses either is stopped and the request fails."""

    idle: float
    until: float

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings, started: float) -> "Deadlines":
        return cls(idle=settings.idle_timeout, until=started + settings.request_timeout)


class Attempt:
    def __init__(self, request_id: str, slot: Slot, bounds: UsageBounds | None = None, api: Api = "chat") -> None:
        self.request_id = request_id
        self.api = api
        self.bounds = bounds
        self.slot = slot
        self.session = slot.session
        self.reply_key = self.session.reply_key()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False
        self.usage: Usage | None = None
        self.failure: Failed | None = None
        self.head: list[dict[str, Any]] = []  # chunks received before the first content
        self.first_content_at: float | None = None
        self.sent = False  # the request went out to the provider (a session that then vanishes took it along)
        self.taken_since_yield = 0  # events the relay took without letting the loop run others

    # sending and ending

    def dispatch(self, call: InferenceCall, provider_model_id: str, max_tokens: int) -> None:
        """Send the sealed request on the claimed slot; the attempt holds the slot until ``release``."""
        session = self.session
        session.open_inbox(self.request_id, self)
        if not session.online:
            # It disconnected after the slot was claimed (close_session already failed what it had):
            # fail now so the caller retries elsewhere instead of waiting out the first-content budget.
            self.on_provider_gone()
            return
        assert session.public_key is not None, "only sessions with an encryption key are routable"
        envelope = self.reply_key.seal_request(call.for_provider(provider_model_id, max_tokens), session.public_key)
        frame = dump(InferenceRequest(request_id=self.request_id, encrypted_body=envelope, api=call.api))
        limit = session.registration.max_request_frame_bytes
        if len(frame) > limit:
            # never sent: a frame over the node's limit would close its socket and every stream on it
            self.on_error(413, f"The sealed request is {len(frame)} bytes; this provider accepts at most {limit}.")
            return
        self.sent = True
        session.link.send_request(self.request_id, self.slot.ticket, frame)
        session.prepare_reply_key()  # the next request's, after this frame

    async def stop(self, grace: float) -> None:
        """Ask the provider to stop and wait up to ``grace`` seconds for its final usage report."""
        if self.finished:
            return
        self._cancel()
        deadline = time.monotonic() + grace
        while not self.finished and (remaining := deadline - time.monotonic()) > 0:
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=remaining)
            except TimeoutError:
                break
            if isinstance(event, Failed):
                self.failure = event

    def release(self) -> None:
        """Free the session's slot; frames arriving later for this request are ignored."""
        self.finished = True
        self.session.close_inbox(self.request_id, self)
        self.slot.release()

    def abandon(self) -> None:
        """Drop an attempt that lost or failed: tell the provider to stop, free the slot. Idempotent."""
        if not self.finished:
            self._cancel()
        self.release()

    def _cancel(self) -> None:
        self.session.link.cancel(self.request_id, self.slot.ticket)

    # the session's deliveries (the attempt is the inbox it opened there)

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

    def unread(self) -> int:
        return self.events.qsize()

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

    # the relay

    async def first_content(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) for the first content chunk or the completion; chunks
        before it accumulate on ``head``. Returns whether the provider already completed. Raises
        ProviderFailure, or TimeoutError at the deadline with nothing lost (callers may wait again)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that races with
            # an arriving event, and the caller (client gone, race lost) would go on retrying
            async with asyncio.timeout(remaining):
                event = await self.events.get()
            if isinstance(event, Failed):
                raise ProviderFailure(event)
            if isinstance(event, Completed):
                return True
            self.head.append(event.data)
            if has_content(event.data):
                self.first_content_at = time.monotonic()
                return False

    async def relay(self, completed: bool, presenter: Presenter, deadlines: Deadlines) -> AsyncIterator[bytes]:
        """The presenter's events for the buffered head and every later chunk, until the provider
        finishes, fails or misses a deadline (then ``usage`` or ``failure`` says which). The events of
        the chunks already waiting go out together (up to _FLUSH_PARTS of them per write): a model
        making one token at a time gets one write per token, a burst (or a relay behind under load)
        far fewer; a long queue is drained with the loop let run every _YIELD_EVERY chunks."""
        parts = list(presenter.stream_start())
        for index, data in enumerate(self.head):
            parts.extend(presenter.stream_chunk(data))
            if index % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        while not completed:
            if parts and (self.events.empty() or len(parts) >= _FLUSH_PARTS):
                yield b"".join(parts)
                parts = []
            event = await self._next_event(deadlines)
            if isinstance(event, Chunk):
                parts.extend(presenter.stream_chunk(event.data))
            elif isinstance(event, Failed):
                self.failure = event
                break
            else:
                completed = True
        if parts:
            yield b"".join(parts)

    async def collect(self, completed: bool, presenter: Presenter, deadlines: Deadlines) -> None:
        """Give the presenter every chunk of a non-streamed answer, until the provider completes (then
        ``usage`` holds its report; the body is ``presenter.response`` once the request is settled)."""
        for index, data in enumerate(self.head):
            presenter.collect(data)
            if index % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        while not completed:
            event = await self._next_event(deadlines)
            if isinstance(event, Chunk):
                presenter.collect(event.data)
            elif isinstance(event, Failed):
                raise ProviderFailure(event)
            else:
                completed = True

    async def _next_event(self, deadlines: Deadlines) -> Event:
        """The provider's next event, or — when it stays silent past a deadline, or floods past the
        request's — a timeout failure (the provider is told to stop)."""
        events = self.events
        if not events.empty():  # already here: no deadline to arm (the common case under load)
            self.taken_since_yield += 1
            if self.taken_since_yield < _YIELD_EVERY:
                return events.get_nowait()
            self.taken_since_yield = 0
            await asyncio.sleep(0)  # a provider that floods the queue never holds the loop
            if time.monotonic() >= deadlines.until:
                return self._timed_out("did not finish within the request deadline")
            if not events.empty():
                return events.get_nowait()
        remaining = deadlines.until - time.monotonic()
        wait = min(deadlines.idle, remaining)
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                return await events.get()
        except TimeoutError:
            return self._timed_out(f"sent nothing for {deadlines.idle:g} s"
                                   if wait == deadlines.idle and remaining > deadlines.idle
                                   else "did not finish within the request deadline")

    def _timed_out(self, why: str) -> Failed:
        failure = Failed(504, f"The provider {why}; the answer is incomplete.", "provider_timeout")
        if not self.finished:
            self._cancel()
        self.finished, self.failure = True, failure
        return failure
