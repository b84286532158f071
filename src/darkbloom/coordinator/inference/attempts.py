"""A request's attempts, each on one claimed slot, to its first content and then its last byte.

An ``Attempt`` seals the request to its provider's key, opens its inbox on the session and sends the
request through the session's link (``dispatch``); the session delivers the node's frames to that
inbox (``on_chunk``, ``on_complete``, ``on_error``, ``on_provider_gone``), the relay takes them out
(``first_content``, then ``relay`` or ``collect``). ``Attempts`` runs them to first content, before
which nothing reaches the client, so a failure is still an HTTP error: a provider that errors,
disconnects or stays silent for the first-content budget is excluded and the next eligible session
tried (at most 3 attempts; retries never queue); a primary silent at half the budget races a backup
on an idle session. A request that took its provider's session down with it (a poison request, maybe)
goes to one more session at most, and fails as ``request_crashed_providers`` when that one goes down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Protocol, Union

from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.inference.calls import Deadlines, TokenBounds
from darkbloom.coordinator.inference import failures
from darkbloom.coordinator.inference.failures import Failed, ProviderFailure
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.scheduler import Claim, claim, load_seconds, select_idle_or_free
from darkbloom.coordinator.services import Services
from darkbloom.wire import json_codec
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire.crypto import DecryptionError
from darkbloom.wire.openai.chunk_shapes import chunk_problem
from darkbloom.wire.openai.chunks import has_content
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.protocol import Api, Envelope, InferenceRequest, Priority, Usage, dump

log = logging.getLogger("darkbloom.attempts")
MAX_ATTEMPTS = 3
SESSIONS_A_REQUEST_MAY_TAKE_DOWN = 2
_YIELD_EVERY = 64  # events the relay takes from a full queue before it lets the loop run others
_FLUSH_PARTS = 256  # events' parts gathered before they go out, even with more chunks waiting

Event = Union[dict[str, Any], Usage, Failed]  # a chunk, the provider's usage report, or how it failed


class Attempt:
    def __init__(self, request_id: str, slot: Slot, bounds: TokenBounds | None = None, api: Api = "chat",
                 priority: Priority = "live") -> None:
        self.request_id = request_id
        self.api = api
        self.priority = priority
        self.bounds = bounds  # the most a provider can truthfully report (docs/billing.md "1. Admission")
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

    def dispatch(self, node_body: dict[str, Any], provider_model_id: str) -> None:
        """Send the sealed request (``node_body`` with the provider's own model id) on the claimed slot;
        the attempt holds the slot until ``release``."""
        session = self.session
        session.open_inbox(self.request_id, self)
        if not session.online:
            # gone since the claim (its close failed what it had): fail now, to be retried elsewhere
            self.on_provider_gone()
            return
        assert session.public_key is not None, "only sessions with an encryption key are routable"
        body = json_codec.dumps(dict(node_body, model=provider_model_id))
        envelope = self.reply_key.seal_request(body, session.public_key)
        frame = dump(InferenceRequest(request_id=self.request_id, encrypted_body=envelope, api=self.api,
                                      priority=self.priority))
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
        """Open a sealed chunk (one OpenAI chunk, or an array the node sent together), each of the
        shape its API reads; False when it does not open (the caller distrusts the provider)."""
        try:
            chunks = response_chunks(self.reply_key.open(envelope))
        except (DecryptionError, ValueError) as exc:
            return self._unopened(f"does not open: {exc}")
        for chunk in chunks:
            problem = chunk_problem(chunk, self.api)
            if problem is not None:
                return self._unopened(f"is malformed: {problem}")
        for chunk in chunks:
            self.events.put_nowait(chunk)
        return True

    def on_complete(self, usage: Usage) -> bool:
        """Record the provider's usage; False when it reports more than the request could have used
        (the request fails unbilled and the caller distrusts the provider)."""
        bounds = self.bounds
        if bounds is not None and (usage.prompt_tokens > bounds.prompt or usage.completion_tokens > bounds.output):
            log.warning("request %s: %s reported usage above the request's bounds (%s; %s)", self.request_id,
                        self.session.id, usage, bounds)
            self._finish(failures.UNTRUSTED_USAGE)
            return False
        self.usage = usage
        self._finish(usage)
        return True

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """The provider failed the request; its ``message`` is not kept (it never reaches a consumer)."""
        self._finish(failures.provider_error(status, param, code))

    def on_provider_gone(self) -> None:
        self._finish(failures.PROVIDER_GONE)

    def unread(self) -> int:
        return self.events.qsize()

    def _unopened(self, why: str) -> bool:
        log.warning("request %s: a chunk from %s %s", self.request_id, self.session.id, why)
        self._finish(failures.UNTRUSTED_CHUNK)
        return False

    def _finish(self, event: Event) -> None:
        if not self.finished:
            self.finished = True
            self.events.put_nowait(event)
            if isinstance(event, Failed):
                self.failure = event

    # the relay

    async def first_content(self, deadline: float) -> bool:
        """Whether the provider completed by its first content chunk (those before it kept on ``head``);
        ProviderFailure, or TimeoutError at ``deadline`` (monotonic) with nothing lost (wait again)."""
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
            if isinstance(event, Usage):
                return True
            self.head.append(event)
            if has_content(event):
                self.first_content_at = time.monotonic()
                return False

    async def relay(self, completed: bool, presenter: Presenter, deadlines: Deadlines) -> AsyncIterator[bytes]:
        """The presenter's events for the head and every later chunk until the provider finishes, fails
        or misses a deadline (``usage`` or ``failure`` says which); waiting chunks go out together."""
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
            if isinstance(event, dict):
                parts.extend(presenter.stream_chunk(event))
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
            if isinstance(event, dict):
                presenter.collect(event)
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
        failure = failures.incomplete(why)
        if not self.finished:
            self._cancel()
        self.finished, self.failure = True, failure
        return failure


class Lifecycle(Protocol):
    """What attempts need of their request's lifecycle (``inference/settlement.py``): it ends what they hold."""

    services: Services
    request_id: str
    bounds: TokenBounds | None

    def hold(self, slot: Slot) -> None: ...
    def track(self, attempt: Attempt) -> None: ...
    def serve_with(self, attempt: Attempt) -> None: ...


class Attempts:
    def __init__(self, life: Lifecycle, decision: RouteDecision, api: Api, node_body: dict[str, Any]) -> None:
        self.life = life
        self.services = life.services
        self.decision = decision
        self.api = api
        self.node_body = node_body  # what every attempt sends, with its provider's own model id
        self.request_id = life.request_id
        self.taken_down = 0  # sessions that went away with this request before any output
        self.sent_since_takedown: int | None = None  # attempts sent after (or still live at) the first

    def _dispatch(self, claimed: Claim) -> Attempt:
        attempt = Attempt(self.request_id, claimed.slot, self.life.bounds, self.api,
                          "batch" if self.decision.batch else "live")
        attempt.dispatch(self.node_body, claimed.provider_model_id)
        self.life.track(attempt)
        if self.sent_since_takedown is not None:
            self.sent_since_takedown += 1
        return attempt

    def _drop(self, attempt: Attempt) -> None:
        attempt.abandon()
        self.decision.excluded.add(attempt.session.id)

    def _failed(self, attempt: Attempt, still_live: int = 0) -> None:
        """Drop a failed attempt, counting its session when the request took it down."""
        if attempt.sent and not attempt.session.online:
            self.taken_down += 1
            if self.sent_since_takedown is None:
                self.sent_since_takedown = still_live  # a backup racing it already is the one more session
        self._drop(attempt)

    async def run(self, first: Claim) -> tuple[Attempt, bool]:
        """The winning attempt (served with, on the lifecycle) and whether it completed, or the last failure."""
        claimed: Claim | None = first
        failure: ProviderFailure | None = None
        for number in range(1, MAX_ATTEMPTS + 1):
            assert claimed is not None
            primary = self._dispatch(claimed)
            try:
                winner, completed = await self._first_content(primary)
                self.life.serve_with(winner)
                return winner, completed
            except ProviderFailure as exc:
                failure = exc
                log.info("request %s: attempt %d on %s failed: %s", self.request_id, number,
                         claimed.session.id, exc.failure.reason)
                if exc.request_fault:
                    raise  # the request's own fault fails that request only
            if self.taken_down >= SESSIONS_A_REQUEST_MAY_TAKE_DOWN:
                log.warning("request %s took down %d provider sessions before any output: not tried again",
                            self.request_id, self.taken_down)
                raise failures.crashed_providers()
            if number == MAX_ATTEMPTS or self.sent_since_takedown:  # it had its one more session
                break  # claiming another slot now would leak it: nothing would ever dispatch or release it
            claimed = self._idle_or_free(require_idle=False)
            if claimed is None:
                break
        assert failure is not None
        raise failure

    def _idle_or_free(self, *, require_idle: bool, owned_only: bool = False) -> Claim | None:
        decision = dataclasses.replace(self.decision, owned_only=True) if owned_only else self.decision
        session = select_idle_or_free(self.services.registry, decision, self.services.settings, require_idle)
        if session is None:
            return None
        claimed = claim(self.services.registry, session, decision)
        self.life.hold(claimed.slot)
        return claimed

    def _clock_starts(self, attempt: Attempt) -> float:
        """When its first-content budget starts: now, or once its node has loaded the model (as estimated)."""
        return time.monotonic() + load_seconds(attempt.session, self.decision)

    async def _first_content(self, primary: Attempt) -> tuple[Attempt, bool]:
        budget = self.services.settings.first_content_timeout
        started = self._clock_starts(primary)
        try:
            return primary, await primary.first_content(started + budget / 2)
        except ProviderFailure:
            self._failed(primary)
            raise
        except TimeoutError:
            pass
        # a prefer request served by an owned session never gets a paid backup
        owned_primary = self.decision.owns(primary.session)
        claimed = (self._idle_or_free(require_idle=True, owned_only=owned_primary)
                   if self.sent_since_takedown is None else None)
        if claimed is None:
            try:
                return primary, await primary.first_content(started + budget)
            except TimeoutError:
                self._drop(primary)
                raise failures.timed_out(budget) from None
            except ProviderFailure:
                self._failed(primary)
                raise
        backup = self._dispatch(claimed)
        log.info("request %s: %s silent after %.1f s, backup on %s", self.request_id, primary.session.id,
                 budget / 2, backup.session.id)
        return await self._race(primary, backup, {primary: started + budget,
                                                  backup: self._clock_starts(backup) + budget})

    async def _race(self, primary: Attempt, backup: Attempt,
                    deadlines: dict[Attempt, float]) -> tuple[Attempt, bool]:
        tasks = {asyncio.ensure_future(a.first_content(deadlines[a])): a for a in (primary, backup)}
        failure: ProviderFailure | None = None
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    attempt = tasks.pop(task)
                    try:
                        completed = task.result()
                    except (ProviderFailure, TimeoutError) as exc:
                        failure = exc if isinstance(exc, ProviderFailure) else failures.timed_out(
                            self.services.settings.first_content_timeout)
                        self._failed(attempt, still_live=len(tasks))
                        continue
                    for other_task, other in tasks.items():
                        other_task.cancel()
                        self._drop(other)
                    return attempt, completed
        finally:
            for task in tasks:
                task.cancel()
        assert failure is not None
        raise failure
