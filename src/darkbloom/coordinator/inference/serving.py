"""Serving one inference request, whatever API it came in on, from the caller to the last byte.

``serve`` reads top to bottom in the order the request goes, each step a call into the module where
it happens: the request's ``RequestLifecycle`` and its RPM charge, before the body is read
(``inference/settlement.py``); the body into one ``InferenceCall`` (``inference/calls.py``); the
route — policy, model, decision — and, with the call's token bounds, its admission (token charges
and the reservation, on the lifecycle); placement on a claimed slot (``routing/route.py``) and the
attempts to first content (``inference/attempts.py``), raced against the client going away
(``inference/disconnect.py``); the answer — the presenter's JSON, or a stream — settled before it
shows its usage, so the ``cost_micro_usd`` in it (and a JSON answer's ``X-Darkbloom-Cost-Micro-USD``)
is what the settlement charged. The lifecycle gives back what the request did not use and settles
the rest, however it ends. ``serve_line`` serves a batch line through the same steps (``_started``):
no client to race, the lowest priority, and its answer handed to its batch before it settles.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any, AsyncIterator, Awaitable, Callable, ContextManager

from prometheus_client import Histogram
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.attempts import Attempt, Attempts
from darkbloom.coordinator.inference.calls import Deadlines, InferenceCall, parse_call
from darkbloom.coordinator.inference.disconnect import DisconnectWatch
from darkbloom.coordinator.inference.failures import ProviderFailure, failure_error
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.money.billing import BatchTerms
from darkbloom.coordinator.routing import route
from darkbloom.coordinator.routing.decision import Policy
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.answers import EventStreamResponse, JsonAnswer
from darkbloom.wire.openai.edges import Edge
from darkbloom.wire.openai.presenters import Presenter

PLACEMENT_SECONDS = Histogram(
    "darkbloom_placement_seconds",
    "From admission to a claimed slot (queueing included), by route mode: public, prefer, exclusive",
    ["route"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
COST_HEADER = "X-Darkbloom-Cost-Micro-USD"  # on non-streamed answers: what the request was charged
FIRST_CONTENT_SECONDS = Histogram(
    "darkbloom_time_to_first_content_seconds",
    "From the coordinator taking a request up to the first content of the attempt that serves it, by API path",
    ["api"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


async def serve(edge: Edge, request: Request, caller: Caller, services: Services,
                read_body: Callable[[], Awaitable[bytes]]) -> StreamingResponse | JSONResponse:
    """The answer to ``request``, a call of ``edge``'s API by ``caller``; ``read_body`` gives its
    body (opened, when it came sealed). Until the answer is ready, the client going away stops the
    work (``ClientDisconnected``); the lifecycle's exit gives back what the request did not use."""
    async with RequestLifecycle(services, caller, edge.id_prefix + secrets.token_hex(12), edge.path) as life:
        request.state.request_id = life.request_id  # also on an error answer (wire.openai.handlers)
        await life.take_request()  # RPM, before the body is read
        call = parse_call(await read_body(), edge)
        policy = route.resolve_policy(request.headers, caller)
        with DisconnectWatch(request) as watch:
            attempt, completed = await _started(services, life, call, policy, watch.race)
            headers = life.answer_headers()
            presenter = call.present(life.request_id)
            deadlines = Deadlines.from_settings(services.settings, life.started)
            if call.stream:
                life.hand_off()
                return EventStreamResponse(_streamed(life, attempt, completed, presenter, deadlines), headers, life)
            try:
                with watch.race():
                    await attempt.collect(completed, presenter, deadlines)
            except ProviderFailure as failure:
                raise failure.as_api_error(call.request) from None
            cost = await life.finish("ok")  # settled before the body: it says what was charged
            assert attempt.usage is not None
            return JsonAnswer(presenter.response(attempt.usage, cost), headers={**headers, COST_HEADER: str(cost)},
                              background=BackgroundTask(_write_log, life))  # the request's line, once it has gone


async def serve_line(edge: Edge, caller: Caller, services: Services, body: bytes, policy: Policy,
                     request_id: str, batch: BatchTerms, placed: Callable[[], None],
                     answered: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """One batch line as one request of ``edge``'s API by ``caller``, at the lowest priority, on the
    route its batch was created with: ``placed`` is called once it holds a slot, and its answer (the
    live endpoint's JSON body) goes to ``answered``, which keeps it before the request settles — if
    that raises (the line is no longer this coordinator's), nothing is charged. Raises the
    ``ApiError`` a live request would have been answered with."""
    async with RequestLifecycle(services, caller, request_id, edge.path, batch) as life:
        call = parse_call(body, edge)
        attempt, completed = await _started(services, life, call, policy, contextlib.nullcontext, placed)
        presenter = call.present(life.request_id)
        try:
            await attempt.collect(completed, presenter, Deadlines.from_settings(services.settings, life.started))
        except ProviderFailure as failure:
            raise failure.as_api_error(call.request) from None
        assert attempt.usage is not None
        await answered(presenter.response(attempt.usage, 0))  # its cost: the usage row's, read with the results
        await life.finish("ok")
    life.write_log()


async def _started(services: Services, life: RequestLifecycle, call: InferenceCall, policy: Policy,
                   race: Callable[[], ContextManager[None]],
                   placed: Callable[[], None] | None = None) -> tuple[Attempt, bool]:
    """The call routed, admitted and placed (then ``placed`` called), and its first attempt to first
    content (or to its end, ``True``), each wait raced with ``race``."""
    model = route.resolve_model(services, life.caller, call.model, policy)
    bounds = call.bounds(model)
    decision = await route.decide(services, life.caller, policy, model, call, context_needed=bounds.context,
                                  output_tokens=bounds.output, batch=life.batch is not None)
    policy = await life.admit(policy, decision, bounds)
    admitted_at = time.monotonic()
    with race():
        first = await route.place(services, decision, policy, life)
    PLACEMENT_SECONDS.labels(policy.mode).observe(time.monotonic() - admitted_at)
    if placed is not None:
        placed()
    try:
        with race():
            attempt, completed = await Attempts(life, decision, call.api, call.node_body(bounds.output)).run(first)
    except ProviderFailure as failure:
        error = failure.as_api_error(call.request)
        if not failure.crashed_providers:  # a poison request is told so, whatever state the machines are in
            error = await route.unserved_error(services, decision, error)
        raise error from None
    route.remember(services, decision, attempt.session)
    first_content_at = attempt.first_content_at or time.monotonic()  # or it completed without content
    FIRST_CONTENT_SECONDS.labels(call.edge.path).observe(first_content_at - life.started)
    return attempt, completed


async def _write_log(life: RequestLifecycle) -> None:
    life.write_log()  # async: Starlette runs a plain function's background task in a thread


async def _streamed(life: RequestLifecycle, attempt: Attempt, completed: bool, presenter: Presenter,
                    deadlines: Deadlines) -> AsyncIterator[bytes]:
    async for part in attempt.relay(completed, presenter, deadlines):
        yield part
    failure = attempt.failure
    cost = await life.finish(failure.reason if failure else "ok")  # settled before the client sees the end
    try:
        if failure is not None:
            for part in presenter.stream_error(failure_error(failure)):
                yield part
        else:
            assert attempt.usage is not None
            for part in presenter.stream_end(attempt.usage, cost):
                yield part
    finally:
        life.write_log()
