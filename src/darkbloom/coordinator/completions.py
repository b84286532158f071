"""One chat completion through the coordinator:
resolve model → admit (rate limits, reservation) → select → seal → dispatch → relay → settle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from darkbloom.catalog import CatalogModel
from darkbloom.coordinator import admission as admission_core
from darkbloom.coordinator import billing, relay
from darkbloom.coordinator.admission import Admission
from darkbloom.coordinator.auth import Caller
from darkbloom.coordinator.chat_request import ChatRequest
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.attempts import Attempts
from darkbloom.coordinator.queueing import NoEligibleSession, QueueRefused
from darkbloom.coordinator import selfroute
from darkbloom.coordinator.scheduler import Placement, RouteDecision, survey
from darkbloom.coordinator.selfroute import Policy, resolve_policy
from darkbloom.coordinator.services import Services
from darkbloom.openai_chunks import SSE_DONE, sse

log = logging.getLogger("darkbloom.completions")
SETTLE_ATTEMPTS = 4


def new_request_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def resolve_model(services: Services, caller: Caller, name: str, policy: Policy) -> CatalogModel:
    """The catalog entry; for self-routed requests also a model only the caller's machines serve
    (free to the owner, so it has no price)."""
    model = services.settings.catalog.resolve(name)
    if model is None and policy.self_routed:
        advertised = policy.exclusive or any(name in s.advertised_models
                                             for s in services.registry.owned_by(caller.account_id))
        if advertised:
            model = CatalogModel(id=name, input_price=0, output_price=0)
    if model is None:
        raise ApiError(404, "model_not_found",
                       f"The model '{name}' does not exist. GET /v1/models lists the models you can use.",
                       param="model")
    allowed = caller.key.get("allowed_models") if caller.key else None
    if allowed is not None and model.id not in allowed and name not in allowed:
        raise ApiError(403, "model_not_allowed",
                       f"This API key may not use '{name}'. Edit the key's allowed models or use another key.",
                       param="model")
    return model


@dataclass
class InFlight:
    """Everything one request decided, carried to its single end (`finish`)."""

    services: Services
    caller: Caller
    chat: ChatRequest
    model: CatalogModel
    policy: Policy
    admission: Admission
    pending: relay.PendingRequest
    started: float = field(default_factory=time.monotonic)
    outcome: str = "ok"

    @property
    def request_id(self) -> str:
        return self.pending.request_id


async def chat_completion(services: Services, caller: Caller, chat: ChatRequest, request: Request,
                          admission: Admission) -> StreamingResponse | JSONResponse:
    request_id = new_request_id()
    try:
        policy = resolve_policy(request.headers, caller)
        model = resolve_model(services, caller, chat.model, policy)
    except BaseException:
        await admission_core.release_rates(services, admission)
        raise
    # a model outside the catalog is reachable only on the caller's own machines, even with prefer:
    # another account's machine advertising the same name is not public fleet for it
    owner_only_model = services.settings.catalog.resolve(model.id) is None
    decision = RouteDecision(model=model, needs_images=chat.uses_images, needs_tools=chat.uses_tools,
                             owner_account_id=policy.owner_account_id,
                             owned_only=policy.exclusive or (policy.self_routed and owner_only_model),
                             pinned=policy.pinned)
    # exclusive self-route never spends: no reservation, no key spend cap (rate limits still apply)
    await admission_core.admit(services, caller, chat, model, request_id, admission, reserve=not policy.exclusive)
    try:
        placement = await _until_disconnect(request, _place(services, decision))
    except BaseException as exc:
        await _finish_unserved(services, admission)
        raise _placement_error(exc, model, policy) from None
    attempts = Attempts(services, decision, chat, request_id, admission.output_bound)
    try:
        pending, completed = await _until_disconnect(request, attempts.run(placement))
    except relay.ProviderFailure as failure:
        await _finish_unserved(services, admission)
        raise await _unserved_error(services, decision, failure) from None
    except BaseException:
        attempts.abandon_all()
        services.spawn(_finish_unserved(services, admission))
        raise
    flight = InFlight(services, caller, chat, model, policy, admission, pending)
    owned = pending.session.account_id == caller.account_id
    headers = {"X-Request-Id": request_id, "X-Provider-Id": pending.session.id,
               "X-Darkbloom-Routed": "owned" if owned else "fleet",
               "X-Darkbloom-Billing": "free" if owned and policy.self_routed else "charged", **admission.headers}
    shaper = relay.ChunkShaper(request_id, chat.model)
    if chat.stream:
        return StreamingResponse(_streamed(flight, completed, shaper), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        body = await _until_disconnect(request, relay.collect(pending, completed, shaper))
    except relay.ProviderFailure as failure:
        await _finish(flight, failure.failure.reason, charge_partial=False)
        raise failure.as_api_error() from None
    except BaseException:
        _finish_later(flight, "client_disconnected", charge_partial=True)
        raise
    await _finish(flight, "ok", charge_partial=False)
    return JSONResponse(body, headers=headers)


async def _place(services: Services, decision: RouteDecision) -> Placement:
    try:
        return await services.queues.place(decision)
    except NoEligibleSession as exc:
        if decision.owned_only:
            await selfroute.preflight(services, decision, exc.survey)
        raise


async def _unserved_error(services: Services, decision: RouteDecision, failure: relay.ProviderFailure) -> ApiError:
    """Every attempt failed before first content. For an exclusive request whose owned machines can
    no longer serve at all (the one serving it died), the named pre-flight error of that state
    (e.g. ``machine_offline``, Retry-After 30) says what to do; otherwise the provider's failure."""
    if decision.owned_only:
        fresh = dataclasses.replace(decision, excluded=set())
        found = survey(services.registry, fresh, services.settings)
        if not found.eligible:
            try:
                await selfroute.preflight(services, fresh, found)
            except ApiError as named:
                return named
    return failure.as_api_error()


def _placement_error(exc: BaseException, model: CatalogModel, policy: Policy) -> BaseException:
    if isinstance(exc, QueueRefused) and policy.exclusive:
        return selfroute.machine_busy(exc.retry_after)
    if isinstance(exc, NoEligibleSession):
        return ApiError(503, "model_unavailable",
                        f"No provider is serving '{model.id}' right now. Try again later or pick another model.")
    if isinstance(exc, QueueRefused):
        why = "the queue is full" if exc.code == "queue_full" else "no slot freed up in time"
        return ApiError(429, "rate_limit_exceeded",
                        f"Every provider serving '{model.id}' is busy and {why}. Retry after {exc.retry_after} s.",
                        code=exc.code, headers={"Retry-After": str(exc.retry_after)})
    return exc


async def _streamed(flight: InFlight, completed: bool, shaper: relay.ChunkShaper) -> AsyncIterator[bytes]:
    pending = flight.pending
    finished = False
    try:
        async for part in relay.relay_chunks(pending, completed, shaper):
            yield part
        failure = pending.failure
        await _finish(flight, failure.reason if failure else "ok", charge_partial=False)
        finished = True
        if failure is not None:
            yield relay.failure_event(failure)
            return
        assert pending.usage is not None
        yield sse(shaper.usage_chunk(pending.usage))
        yield SSE_DONE
    finally:
        if not finished:
            _finish_later(flight, "client_disconnected", charge_partial=True)


async def _finish(flight: InFlight, outcome: str, *, charge_partial: bool) -> None:
    """The one end of every dispatched request, shielded so a vanished client cannot cut it short."""
    task = flight.services.spawn(_settle(flight, outcome, charge_partial))
    await asyncio.shield(task)


def _finish_later(flight: InFlight, outcome: str, *, charge_partial: bool) -> None:
    flight.services.spawn(_settle(flight, outcome, charge_partial))


async def _settle(flight: InFlight, outcome: str, charge_partial: bool) -> None:
    services, pending, admission = flight.services, flight.pending, flight.admission
    if charge_partial:
        await relay.stop(pending, services.settings.cancel_grace)
    relay.release(pending)
    services.queues.drain()
    _measure_decode_speed(pending)
    usage = pending.usage if (outcome == "ok" or charge_partial) else None
    reservation = admission.reservation
    session = pending.session
    # the owner is re-read from the serving session object, even if it has disconnected since
    served = billing.Served(provider_id=session.id, provider_account_id=session.account_id)
    bill = billing.Bill(pending.request_id, flight.caller.account_id, flight.caller.key_id, flight.model,
                        reservation, flight.policy.self_routed)
    for attempt in range(1, SETTLE_ATTEMPTS + 1):
        try:
            # both steps are idempotent on the request id, so a retry after a transient error is safe
            if usage is not None:
                await billing.settle_bill(services, bill, usage, served)
            elif reservation is not None:
                await billing.refund(services, reservation)
            break
        except Exception:  # noqa: BLE001 - retried, then left to the reconciler at the next restart
            log.exception("request %s: settlement attempt %d failed", pending.request_id, attempt)
            await asyncio.sleep(0.2 * 2 ** attempt)
    await admission_core.reconcile_rates(services, admission, usage.prompt_tokens if usage else 0,
                                         usage.completion_tokens if usage else 0)
    _log(flight, outcome if usage is not None or outcome != "client_disconnected" else "client_disconnected_unbilled")


DECODE_SPEED_WEIGHT = 0.2


def _measure_decode_speed(pending: relay.PendingRequest) -> None:
    """Keep an EWMA of the session's completion tokens per second (used to rank sessions)."""
    usage, started = pending.usage, pending.first_content_at
    if usage is None or started is None or usage.completion_tokens < 2:
        return
    elapsed = time.monotonic() - started
    if elapsed <= 0:
        return
    observed = usage.completion_tokens / elapsed
    session = pending.session
    session.decode_tps = observed if session.decode_tps <= 0 else (
        (1 - DECODE_SPEED_WEIGHT) * session.decode_tps + DECODE_SPEED_WEIGHT * observed)


async def _finish_unserved(services: Services, admission: Admission) -> None:
    if admission.reservation is not None:
        await billing.refund(services, admission.reservation)
    await admission_core.reconcile_rates(services, admission, 0, 0)


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client goes away first (then cancel it and raise)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _log(flight: InFlight, outcome: str) -> None:
    usage = flight.pending.usage
    log.info("request_id=%s account=%s key=%s model=%s provider=%s outcome=%s prompt_tokens=%s "
             "completion_tokens=%s ms=%d", flight.request_id, flight.caller.account_id, flight.caller.key_id,
             flight.model.id, flight.pending.session.id, outcome, usage.prompt_tokens if usage else None,
             usage.completion_tokens if usage else None, (time.monotonic() - flight.started) * 1000)
