"""One request's route, from its headers to a claimed slot: the route policy, the model, the request's
one ``RouteDecision`` (the shares it may use, the session that served its conversation before, the
context it needs) and its placement, or the named error when it cannot be placed or its owned
machines can no longer serve it.

The policy comes only from server-side facts (docs/self-route.md "Three ways to ask for your own
machine", docs/sharing.md): the ``X-Darkbloom-Route`` header (a request, never a body field), the API
key's ``self_route_only`` and ``shared_only`` ceilings and the authenticated account. The header can
ask for self-routing; it can never name an owner (a share it names must be one the caller received).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from starlette.datastructures import Headers

from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.routing import selfroute
from darkbloom.coordinator.routing.decision import Policy, RouteDecision, RouteMode, ShareGrant
from darkbloom.coordinator.routing.queue import NoEligibleSession, QueueRefused
from darkbloom.coordinator.routing.scheduler import Claim, blocked_by_capability, longest_context, survey
from darkbloom.coordinator.routing.sharing import load_grants
from darkbloom.coordinator.services import Services
from darkbloom.wire.catalog import MAX_MODEL_ID, CatalogModel
from darkbloom.wire.openai.errors import ApiError, invalid_request
from darkbloom.wire.protocol import Api

ROUTE_HEADER = "x-darkbloom-route"
MACHINE_HEADER = "x-darkbloom-machine"
SHARE_HEADER = "x-darkbloom-share"
MAX_MACHINE_ID = 256
_MODES: dict[str, RouteMode] = {"self": "exclusive", "prefer": "prefer", "shared": "shared"}
_NEED_PARAMS = {"tools": "tools", "structured_output": "response_format", "logprobs": "logprobs",
                "completions": "model", "completion_batches": "prompt", "embeddings": "model", "images": "messages"}


class Routed(Protocol):
    """What routing reads of the call it routes (``inference.calls.InferenceCall``)."""

    @property
    def api(self) -> Api: ...

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def needs(self) -> frozenset[str]: ...


class Holder(Protocol):
    """What placement needs of the request's lifecycle (``inference.settlement.RequestLifecycle``),
    which gives back on every end what the request took."""

    def hold(self, slot: Slot) -> None:
        """Take a claimed slot at once."""

    async def take_share(self, grant: ShareGrant) -> bool:
        """Take the share's daily allowance for the request (False: used up, nothing taken)."""


def resolve_policy(headers: Headers, caller: Caller, *, with_pin: bool = True) -> Policy:
    """Header intent, capped by the key's ``self_route_only`` (which wins) or ``shared_only``; the
    owner is always the caller."""
    values = headers.getlist(ROUTE_HEADER)
    first = values[0].split(",")[0].strip().lower() if values else ""
    mode = _MODES.get(first, "public")
    if caller.key and caller.key.self_route_only:
        mode = "exclusive"
    elif caller.key and caller.key.shared_only:
        mode = "shared"
    pinned = _one_id(headers, MACHINE_HEADER, "X-Darkbloom-Machine", "one machine", mode == "exclusive",
                     "an exclusive self-route request (X-Darkbloom-Route: self or a self_route_only key)"
                     ) if with_pin else None
    share_id = _one_id(headers, SHARE_HEADER, "X-Darkbloom-Share", "one share", mode == "shared",
                       "shared routing (X-Darkbloom-Route: shared or a shared_only key)") if with_pin else None
    return Policy(mode, caller.account_id if mode != "public" else None, pinned, share_id)


def _one_id(headers: Headers, header: str, name: str, what: str, allowed: bool, needs: str) -> str | None:
    """The id a narrowing header names, or None when it is absent; 400 naming the header when it is
    sent without the route mode it narrows, twice, blank, with a comma, or too long."""
    values = headers.getlist(header)
    if not values:
        return None

    def bad(why: str) -> ApiError:
        return invalid_request(f"{name} {why}.", param=name)

    if not allowed:
        raise bad(f"only works with {needs}")
    if len(values) > 1:
        raise bad("must be sent once")
    value = values[0].strip()
    if not value:
        raise bad("must not be blank")
    if "," in value:
        raise bad(f"names {what}: no commas")
    if len(value) > MAX_MACHINE_ID:
        raise bad(f"must be at most {MAX_MACHINE_ID} characters")
    return value


def resolve_model(services: Services, caller: Caller, name: str, policy: Policy) -> CatalogModel:
    """The catalog entry; for self-routed requests also a model only the caller's machines serve
    (free to the owner, so it has no price)."""
    model = services.settings.catalog.resolve(name)
    if model is None and policy.self_routed and len(name) <= MAX_MODEL_ID:
        advertised = policy.never_fleet or any(name in s.advertised_models
                                               for s in services.registry.owned_by(caller.account_id))
        if advertised:
            model = CatalogModel(id=name, input_price=0, output_price=0)
    if model is None:
        shown = name if len(name) <= MAX_MODEL_ID else name[:MAX_MODEL_ID] + "…"
        raise ApiError(404, "model_not_found",
                       f"The model '{shown}' does not exist. GET /v1/models lists the models you can use.",
                       param="model")
    allowed = caller.key.allowed_models if caller.key else None
    if allowed is not None and model.id not in allowed and name not in allowed:
        raise ApiError(403, "model_not_allowed",
                       f"This API key may not use '{name}'. Edit the key's allowed models or use another key.",
                       param="model")
    return model


async def decide(services: Services, caller: Caller, policy: Policy, model: CatalogModel, call: Routed, *,
                 context_needed: int, output_tokens: int, batch: bool = False) -> RouteDecision:
    """The request's one decision: the shares it may use (shared routing: read for each request, so a
    revoked share is refused at once), the session that served its conversation before, and the
    context it may take — 400 at once when that fits no session it may use. ``batch``: a batch line
    (the lowest priority)."""
    grants = await load_grants(services, caller, policy.share_id) if policy.shared else None
    conversation = services.affinity.conversation(caller.account_id, model.id, call.api, call.body)
    # a model outside the catalog is reachable only on the caller's own machines, even with prefer:
    # another account's machine advertising the same name is not public fleet for it
    owner_only_model = services.settings.catalog.resolve(model.id) is None
    decision = RouteDecision(model=model, needs=call.needs, owner_account_id=policy.owner_account_id,
                             owned_only=policy.never_fleet or (policy.self_routed and owner_only_model),
                             pinned=policy.pinned, context_needed=context_needed, output_tokens=output_tokens,
                             shares=grants.usable if grants else (),
                             exhausted_shares=grants.exhausted if grants else (), shared_routing=policy.shared,
                             affinity=services.affinity.recall(conversation), conversation=conversation,
                             batch=batch)
    check_context(services, decision)  # before anything is taken
    return decision


def check_context(services: Services, decision: RouteDecision) -> None:
    """400 ``context_length_exceeded`` when the request cannot fit the context of any session it may
    use (before anything is reserved); a session that does not say its context never refuses. When
    no session may serve it at all, placement says why instead."""
    needed = decision.context_needed
    longest = longest_context(services.registry, decision, services.settings) if needed else 0
    if 0 < longest < needed:
        raise ApiError(400, "invalid_request_error",
                       f"This request needs about {needed} tokens of context (its prompt, estimated from its "
                       f"size, and max_tokens), but the longest context of a provider serving "
                       f"'{decision.model.id}' is {int(longest)} tokens. Shorten the prompt or lower max_tokens.",
                       code="context_length_exceeded", param="messages")


async def place(services: Services, decision: RouteDecision, policy: Policy, life: Holder) -> Claim:
    """A claimed slot now or after the queue; otherwise the named error of why not. The request's
    lifecycle holds each claimed slot at once. The session's link confirms the claim (at once here;
    one NATS round trip for another replica's session); when it is refused (the session is busy or
    gone there), the slot is given back and the request placed again, as if that slot had not been
    free. A slot on a shared machine also takes the share's daily allowance; when that is used up,
    the share is dropped and the request placed again. Once placed, a shared request keeps to what
    it took: the caller's own machines, and the share it was placed through (its retries and backup)."""
    while True:
        claimed = await _place(services, decision, policy)
        life.hold(claimed.slot)
        if not await claimed.session.link.confirm(claimed.slot.ticket):
            claimed.slot.release()
            continue
        grant = None if decision.owns(claimed.session) else decision.granted(claimed.session)
        if grant is None:
            decision.shares = ()  # on the caller's own machine: retries and the backup stay on theirs
            return claimed
        if await life.take_share(grant):
            decision.only_through(grant)
            return claimed
        claimed.slot.release()
        decision.exhaust(grant)


async def _place(services: Services, decision: RouteDecision, policy: Policy) -> Claim:
    try:
        return await services.queues.place(decision)
    except NoEligibleSession as exc:
        if decision.shared_routing:
            await selfroute.shared_preflight(services, decision, exc.survey)
        if decision.owned_only:
            await selfroute.preflight(services, decision, exc.survey)
        if blocked_by_capability(services.registry, decision, services.settings):
            # sessions pass every other gate but cannot take this request's shape: no retry will help
            raise ApiError(400, "model_capability_unsupported",
                           f"No provider serving '{decision.model.id}' supports {decision.needs_in_words()}. Send the "
                           "request without it or pick a model that supports it.",
                           param=_NEED_PARAMS.get(min(decision.needs, default=""), "messages")) from None
        raise ApiError(503, "model_unavailable",
                       f"No provider is serving '{decision.model.id}' right now. Try again later or pick "
                       "another model.") from None
    except QueueRefused as exc:
        if policy.never_fleet:
            raise selfroute.machine_busy(exc.retry_after, shared=policy.shared) from None
        why = "the queue is full" if exc.code == "queue_full" else "no slot freed up in time"
        raise ApiError(429, "rate_limit_exceeded",
                       f"Every provider serving '{decision.model.id}' is busy and {why}. "
                       f"Retry after {exc.retry_after} s.",
                       code=exc.code, headers={"Retry-After": str(exc.retry_after)}) from None


def remember(services: Services, decision: RouteDecision, session: ProviderSession) -> None:
    """The session serving the request, where its conversation's next turn finds its cache."""
    if decision.conversation is not None:
        services.affinity.remember(decision.conversation, session.id)


async def unserved_error(services: Services, decision: RouteDecision, failure: ApiError) -> ApiError:
    """Every attempt failed before first content. For an exclusive request whose owned machines can
    no longer serve at all (the one serving it died), the named pre-flight error of that state
    (e.g. ``machine_offline``, Retry-After 30) says what to do; otherwise the provider's failure."""
    if decision.owned_only:
        fresh = dataclasses.replace(decision, excluded=set())
        found = survey(services.registry, fresh, services.settings)
        if not found.eligible:
            try:
                if fresh.shared_routing:
                    await selfroute.shared_preflight(services, fresh, found)
                await selfroute.preflight(services, fresh, found)
            except ApiError as named:
                return named
    return failure
