"""One inference request through the coordinator, whatever API it came in on:
resolve policy and model → admit (rate limits, reservation) → place → attempts (seal, dispatch) →
relay → settle, answered by the call's presenter. The request's ``RequestLifecycle`` owns every
undo along the way."""

from __future__ import annotations

import secrets
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.fleet.pending import PendingRequest
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.disconnect import DisconnectWatch
from darkbloom.coordinator.inference import relay
from darkbloom.coordinator.inference.attempts import Attempts
from darkbloom.coordinator.inference.calls import Edge, InferenceCall
from darkbloom.coordinator.inference.failures import failure_error
from darkbloom.coordinator.inference.lifecycle import RequestLifecycle
from darkbloom.coordinator.money.estimation import output_token_bound, prompt_token_bound
from darkbloom.coordinator.routing import placement
from darkbloom.coordinator.routing.policy import Policy
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.openai.streaming import EventStreamResponse


def new_request_id(edge: Edge) -> str:
    return edge.id_prefix + secrets.token_hex(12)


async def serve(life: RequestLifecycle, call: InferenceCall, policy: Policy,
                request: Request) -> StreamingResponse | JSONResponse:
    """Serve ``call`` inside ``life`` (already charged for RPM); ``life``'s exit gives back the rest.
    Until the answer is ready, the client going away stops the work (``ClientDisconnected``)."""
    watch = DisconnectWatch(request)
    try:
        return await _serve(life, call, policy, watch)
    finally:
        watch.close()  # a streamed answer's own response notices a client that goes away later


async def _serve(life: RequestLifecycle, call: InferenceCall, policy: Policy,
                 watch: DisconnectWatch) -> StreamingResponse | JSONResponse:
    services, caller = life.services, life.caller
    model = placement.resolve_model(services, caller, call.model, policy)
    decision = placement.decide(services, policy, model, needs=call.needs)
    output_bound = output_token_bound(call, model)
    # exclusive self-route never spends: no reservation, no key spend cap (rate limits still apply)
    await life.admit(model, prompt_token_bound(call), output_bound, self_routed=policy.self_routed,
                     reserve=not policy.exclusive)
    first = await watch.until(placement.place(services, decision, policy, life.hold))
    attempts = Attempts(life, decision, call, output_bound)
    try:
        pending, completed = await watch.until(attempts.run(first))
    except relay.ProviderFailure as failure:
        error = failure.as_api_error(call.request)
        if not failure.crashed_providers:  # a poison request is told so, whatever state the machines are in
            error = await placement.unserved_error(services, decision, error)
        raise error from None
    headers = _routing_headers(life, caller, pending, policy)
    presenter = call.present(life.request_id)
    deadlines = relay.Deadlines.from_settings(services.settings, life.started)
    if call.stream:
        life.hand_off()
        events = _streamed(life, pending, completed, presenter, deadlines)
        return EventStreamResponse(events, headers, life.end_unfinished)
    try:
        body = await watch.until(relay.collect(pending, completed, presenter, deadlines))
    except relay.ProviderFailure as failure:
        raise failure.as_api_error(call.request) from None
    return JSONResponse(body, headers=headers)


def _routing_headers(life: RequestLifecycle, caller: Caller, pending: PendingRequest,
                     policy: Policy) -> dict[str, str]:
    owned = pending.session.account_id == caller.account_id
    return {"X-Request-Id": life.request_id, "X-Provider-Id": pending.session.id,
            "X-Darkbloom-Routed": "owned" if owned else "fleet",
            "X-Darkbloom-Billing": "free" if (owned and policy.self_routed) or policy.exclusive else "charged",
            **life.rate_headers}


async def _streamed(life: RequestLifecycle, pending: PendingRequest, completed: bool, presenter: Presenter,
                    deadlines: relay.Deadlines) -> AsyncIterator[bytes]:
    async for part in relay.relay_chunks(pending, completed, presenter, deadlines):
        yield part
    failure = pending.failure
    await life.finish(failure.reason if failure else "ok")  # settled before the client sees the end
    if failure is not None:
        for part in presenter.stream_error(failure_error(failure)):
            yield part
        return
    assert pending.usage is not None
    for part in presenter.stream_end(pending.usage):
        yield part
