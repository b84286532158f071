"""Serving one inference request, whatever API it came in on, from the caller to the last byte.

``serve`` reads top to bottom in the order the request goes: the RPM charge (before the body is
read, never given back), the body into one ``InferenceCall``, the route policy, the model,
admission (token charges and the reservation), placement on a claimed slot, the attempts to first
content, and the answer
— the presenter's JSON, or a stream — settled before it shows its usage, so the ``cost_micro_usd``
in it (and a JSON answer's ``X-Darkbloom-Cost-Micro-USD``) is what the settlement charged. Everything the request takes
is recorded on its ``RequestLifecycle`` (``inference/settlement.py``), which gives back what was
not used and settles the rest, however the request ends.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import AsyncIterator, Awaitable, Callable

from prometheus_client import Histogram
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.attempt import Attempt, Deadlines
from darkbloom.coordinator.inference.attempts import Attempts
from darkbloom.coordinator.inference.calls import parse_call
from darkbloom.coordinator.inference.disconnect import DisconnectWatch
from darkbloom.coordinator.inference.failures import ProviderFailure, failure_error
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.money.admission import take_request
from darkbloom.coordinator.money.billing import worst_case
from darkbloom.coordinator.money.estimation import context_needed, output_token_bound, prompt_token_bound
from darkbloom.coordinator.routing import placement
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.sharing import load_grants
from darkbloom.coordinator.routing.policy import Policy, resolve_policy
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.edges import Edge
from darkbloom.wire.openai.presenters import Presenter
from darkbloom.wire.openai.answers import EventStreamResponse, JsonAnswer

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
        life.rate_headers.update(await take_request(services, caller))  # RPM, before the body is read
        call = parse_call(await read_body(), edge)
        policy = resolve_policy(request.headers, caller)
        with DisconnectWatch(request) as watch:
            grants = await load_grants(services, caller, policy.share_id) if policy.shared else None
            model = placement.resolve_model(services, caller, call.model, policy)
            prompt_bound, output_bound = prompt_token_bound(call), output_token_bound(call, model)
            conversation = services.affinity.conversation(caller.account_id, model.id, call.api, call.body)
            decision = placement.decide(services, policy, model, needs=call.needs, grants=grants,
                                        context_needed=context_needed(call, prompt_bound, output_bound),
                                        output_tokens=output_bound, affinity=services.affinity.recall(conversation))
            placement.check_context(services, decision)  # before anything is taken
            policy = await _admit(life, policy, decision, prompt_bound, output_bound)
            admitted_at = time.monotonic()
            first = await watch.until(placement.place(services, decision, policy, life.hold, life.take_share))
            PLACEMENT_SECONDS.labels(policy.mode).observe(time.monotonic() - admitted_at)
            try:
                attempt, completed = await watch.until(Attempts(life, decision, call, output_bound).run(first))
            except ProviderFailure as failure:
                error = failure.as_api_error(call.request)
                if not failure.crashed_providers:  # a poison request is told so, whatever state the machines are in
                    error = await placement.unserved_error(services, decision, error)
                raise error from None
            services.affinity.remember(conversation, attempt.session.id)  # where its next turn finds its cache
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
                await watch.until(attempt.collect(completed, presenter, deadlines))
            except ProviderFailure as failure:
                raise failure.as_api_error(call.request) from None
            cost = await life.finish("ok")  # settled before the body: it says what was charged
            assert attempt.usage is not None
            return JsonAnswer(presenter.response(attempt.usage, cost), headers={**headers, COST_HEADER: str(cost)},
                              background=BackgroundTask(_write_log, life))  # the request's line, once it has gone


async def _admit(life: RequestLifecycle, policy: Policy, decision: RouteDecision, prompt_bound: int,
                 output_bound: int) -> Policy:
    """Token charges and the reservation the route needs: none for exclusive self-route (no key spend
    cap either; rate limits still apply), the worst case at the dearest priced share for shared
    routing — and when the balance cannot hold that but the caller's own machines or a free share
    could serve, no reservation and only those (docs/sharing.md "Money"). A prefer request whose key's
    fallback budget cannot hold its worst case goes on as exclusive (docs/self-route.md "Fallback
    budget"): the policy it is placed with is returned."""
    model = decision.model
    if not policy.shared:
        prefer = policy.mode == "prefer"
        await life.admit(model, prompt_bound, output_bound, self_routed=policy.self_routed,
                         reserve=not policy.exclusive, prefer=prefer)
        if prefer and life.exclusive:
            decision.owned_only = True
            return dataclasses.replace(policy, mode="exclusive")
        return policy
    min_charge = life.services.settings.min_charge_micro_usd
    priced = [grant.priced_model(model) for grant in decision.shares if grant.priced]
    dearest = max(priced, key=lambda m: worst_case(m, prompt_bound, output_bound, min_charge), default=None)
    free_route = (any(not grant.priced for grant in decision.shares)
                  or any(name in s.advertised_models for s in life.services.registry.owned_by(life.caller.account_id)
                         for name in decision.names))
    await life.admit(model, prompt_bound, output_bound, self_routed=True, reserve=dearest is not None,
                     reserve_at=dearest, unreserved_if_short=free_route)
    if dearest is not None and life.reservation is None:
        decision.shares = tuple(grant for grant in decision.shares if not grant.priced)
    return policy


def _routing_headers(life: RequestLifecycle, attempt: Attempt, policy: Policy) -> dict[str, str]:
    owned = attempt.session.account_id == life.caller.account_id
    shared = not owned and life.share is not None
    free = (owned and policy.self_routed) or policy.exclusive or (shared and not life.share.priced)  # type: ignore[union-attr]
    return {"X-Request-Id": life.request_id, "X-Provider-Id": attempt.session.id,
            "X-Darkbloom-Routed": "owned" if owned else "shared" if shared else "fleet",
            "X-Darkbloom-Billing": "free" if free else "charged",
            **life.rate_headers}


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
