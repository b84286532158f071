"""Serving one inference request, whatever API it came in on, from the caller to the last byte.

``serve`` reads top to bottom in the order the request goes: the RPM charge (before the body is
read), the body into one ``InferenceCall``, the route policy, the model, admission (token charges
and the reservation), placement on a claimed slot, the attempts to first content, and the answer
— the presenter's JSON, or a stream — whose end settles the request. Everything the request takes
is recorded on its ``RequestLifecycle`` (``inference/settlement.py``), which gives back what was
not used and settles the rest, however the request ends.
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncIterator, Awaitable, Callable

from prometheus_client import Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.attempt import Attempt, Deadlines
from darkbloom.coordinator.inference.attempts import Attempts
from darkbloom.coordinator.inference.calls import parse_call
from darkbloom.coordinator.inference.disconnect import DisconnectWatch
from darkbloom.coordinator.inference.failures import ProviderFailure, failure_error
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.money.admission import request_charges
from darkbloom.coordinator.money.estimation import context_needed, output_token_bound, prompt_token_bound
from darkbloom.coordinator.routing import placement
from darkbloom.coordinator.routing.policy import Policy, resolve_policy
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.edges import Edge
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.openai.streaming import EventStreamResponse

PLACEMENT_SECONDS = Histogram(
    "darkbloom_placement_seconds",
    "From admission to a claimed slot (queueing included), by route mode: public, prefer, exclusive",
    ["route"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
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
        await life.charge_rates(request_charges(services, caller))  # RPM, before the body is read
        call = parse_call(await read_body(), edge)
        policy = resolve_policy(request.headers, caller)
        with DisconnectWatch(request) as watch:
            model = placement.resolve_model(services, caller, call.model, policy)
            prompt_bound, output_bound = prompt_token_bound(call), output_token_bound(call, model)
            decision = placement.decide(services, policy, model, needs=call.needs,
                                        context_needed=context_needed(call, prompt_bound, output_bound))
            placement.check_context(services, decision)  # before anything is taken
            # exclusive self-route never spends: no reservation, no key spend cap (rate limits still apply)
            await life.admit(model, prompt_bound, output_bound, self_routed=policy.self_routed,
                             reserve=not policy.exclusive)
            admitted_at = time.monotonic()
            first = await watch.until(placement.place(services, decision, policy, life.hold))
            PLACEMENT_SECONDS.labels(policy.mode).observe(time.monotonic() - admitted_at)
            try:
                attempt, completed = await watch.until(Attempts(life, decision, call, output_bound).run(first))
            except ProviderFailure as failure:
                error = failure.as_api_error(call.request)
                if not failure.crashed_providers:  # a poison request is told so, whatever state the machines are in
                    error = await placement.unserved_error(services, decision, error)
                raise error from None
            first_content_at = attempt.first_content_at or time.monotonic()  # or it completed without content
            FIRST_CONTENT_SECONDS.labels(edge.path).observe(first_content_at - life.started)
            headers = _routing_headers(life, attempt, policy)
            presenter = call.present(life.request_id)
            deadlines = Deadlines.from_settings(services.settings, life.started)
            if call.stream:
                life.hand_off()
                events = _streamed(life, attempt, completed, presenter, deadlines)
                return EventStreamResponse(events, headers, life.end_unfinished)
            try:
                body = await watch.until(attempt.collect(completed, presenter, deadlines))
            except ProviderFailure as failure:
                raise failure.as_api_error(call.request) from None
            return JSONResponse(body, headers=headers)


def _routing_headers(life: RequestLifecycle, attempt: Attempt, policy: Policy) -> dict[str, str]:
    owned = attempt.session.account_id == life.caller.account_id
    return {"X-Request-Id": life.request_id, "X-Provider-Id": attempt.session.id,
            "X-Darkbloom-Routed": "owned" if owned else "fleet",
            "X-Darkbloom-Billing": "free" if (owned and policy.self_routed) or policy.exclusive else "charged",
            **life.rate_headers}


async def _streamed(life: RequestLifecycle, attempt: Attempt, completed: bool, presenter: Presenter,
                    deadlines: Deadlines) -> AsyncIterator[bytes]:
    async for part in attempt.relay(completed, presenter, deadlines):
        yield part
    failure = attempt.failure
    await life.finish(failure.reason if failure else "ok")  # settled before the client sees the end
    if failure is not None:
        for part in presenter.stream_error(failure_error(failure)):
            yield part
        return
    assert attempt.usage is not None
    for part in presenter.stream_end(attempt.usage):
        yield part
