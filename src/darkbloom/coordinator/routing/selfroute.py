"""Self-Route's errors (the pre-flight table of docs/self-route.md "When your machine can't serve (exclusive
only)"): why an exclusive request for the caller's own machine cannot be served, each as a named error with
a sentence that says what to do."""

from __future__ import annotations

import dataclasses

from darkbloom.coordinator.errors import machine_not_found
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.gates import CONTEXT_GATE, GATES
from darkbloom.coordinator.routing.scheduler import Survey, candidates, survey
from darkbloom.coordinator.routing.sharing import no_shared_machine, share_quota_exceeded
from darkbloom.coordinator.services import Services
from darkbloom.store import machines
from darkbloom.wire.openai.errors import ApiError

# ``untrusted`` first, then the privacy gates (never relaxed for owners) in name order
_BLOCKING_GATES = sorted((g for g in GATES if g.blocker), key=lambda g: (g.name != "untrusted", g.name))


def machine_offline(pinned: bool, shared: bool = False) -> ApiError:
    if shared:
        return ApiError(503, "machine_offline",
                        "Your machines and the machines shared with you are offline — start your Darkbloom node "
                        "(`darkbloom serve`) or ask the owner of a shared machine to start theirs, and retry.",
                        headers={"Retry-After": "30"})
    which = "That machine is" if pinned else "Your machine is"
    return ApiError(503, "machine_offline",
                    f"{which} offline — start your Darkbloom node (`darkbloom serve`) and retry.",
                    headers={"Retry-After": "30"})


def no_linked_machine() -> ApiError:
    return ApiError(409, "no_linked_machine",
                    "No machine is linked to your account. Run `darkbloom login` on your machine to link it, "
                    "then `darkbloom serve`.")


def model_not_loaded(model: str, shared: bool = False) -> ApiError:
    if shared:
        return ApiError(503, "model_not_loaded",
                        f"The machines you can use (yours and those shared with you) are online but none serves "
                        f"'{model}'. Pick a model one of them serves (GET /v1/models with X-Darkbloom-Route: shared).",
                        headers={"Retry-After": "15"})
    return ApiError(503, "model_not_loaded",
                    f"Your machine is online but does not serve '{model}'. Start your node with "
                    f"`darkbloom serve --model {model}` or pick a model it serves (GET /v1/me/self-route-models).",
                    headers={"Retry-After": "15"})


def machine_busy(retry_after: int, shared: bool = False) -> ApiError:
    which = ("The machines you can use (yours and those shared with you) are" if shared
             else "Your machine is")
    advice = "" if shared else ", or raise its max_concurrency"
    return ApiError(429, "machine_busy", f"{which} busy with other requests. Retry in {retry_after} s{advice}.",
                    headers={"Retry-After": str(max(1, retry_after))})


def preflight_error(decision: RouteDecision, found: Survey, *, ever_linked: bool, pinned_owned: bool,
                    owned_online: int) -> ApiError:
    """Why an exclusive request cannot be served, in the order of the table in docs/self-route.md "When your
    machine can't serve (exclusive only)"; for shared routing, over own and shared machines (worded so)."""
    shared = decision.shared_routing
    yours = "A machine you can use" if shared else "Your machine"
    if decision.pinned and not pinned_owned:
        return machine_not_found()
    if decision.pinned and owned_online == 0:
        return machine_offline(pinned=True)
    if not ever_linked:
        return no_linked_machine()
    if owned_online == 0:
        return machine_offline(pinned=False, shared=shared)
    reasons = found.reasons
    if reasons.get("capability_unsupported"):
        return ApiError(503, "model_unavailable",
                        f"{yours} serves '{decision.model.id}' but not with {decision.needs_in_words()}. "
                        "Send the request without it or load a model that supports it.",
                        code="model_capability_unsupported")
    blockers = [gate.blocker for gate in _BLOCKING_GATES if reasons.get(gate.name)]
    if blockers:
        why = "; ".join(blockers)
        return ApiError(503, "model_routing_blocked",
                        f"{yours} serves '{decision.model.id}' but cannot be used privately right now: {why}.")
    if reasons.get(CONTEXT_GATE):
        return ApiError(400, "invalid_request_error",
                        f"This request needs up to {decision.context_needed} tokens of context, more than "
                        f"{yours.lower()} serves '{decision.model.id}' with. Shorten the prompt or lower max_tokens.",
                        code="context_length_exceeded", param="messages")
    return model_not_loaded(decision.model.id, shared=shared)


async def preflight(services: Services, decision: RouteDecision, found: Survey) -> None:
    """For an exclusive request with no eligible owned session: raise the right named error."""
    account_id = decision.owner_account_id
    assert account_id is not None
    owned = services.registry.owned_by(account_id)
    pinned_owned = False
    if decision.pinned:
        pinned = decision.pinned
        live = [s for s in owned if pinned in (s.id, s.machine_id)]
        if live:
            pinned_owned = True
        elif pinned.startswith("mach_"):
            async with services.engine.connect() as conn:
                row = await machines.get(conn, pinned)
            pinned_owned = row is not None and row["account_id"] == account_id and row["unlinked_at"] is None
        owned = set(live)
    async with services.engine.connect() as conn:
        ever_linked = await machines.ever_linked(conn, account_id)
    online = sum(1 for s in owned if s.online)
    raise preflight_error(decision, found, ever_linked=ever_linked, pinned_owned=pinned_owned,
                          owned_online=online)


async def shared_preflight(services: Services, decision: RouteDecision, found: Survey) -> None:
    """For a shared request with no eligible session among the caller's machines and those shared
    with them (docs/sharing.md "When no machine can serve"): the shares' own errors first, then the
    exclusive table over own and shared machines together."""
    settings, registry = services.settings, services.registry
    if decision.exhausted_shares:
        behind_limits = dataclasses.replace(decision, shares=decision.exhausted_shares, exhausted_shares=(),
                                            excluded=set())
        if any(not decision.owns(s) for s in survey(registry, behind_limits, settings).eligible):
            raise share_quota_exceeded()
    account_id = decision.owner_account_id
    assert account_id is not None
    if not decision.shares and not decision.exhausted_shares:
        async with services.engine.connect() as conn:
            if not await machines.ever_linked(conn, account_id):
                raise no_shared_machine()
        return  # the caller's own machines: the exclusive table
    online = sum(1 for s in candidates(registry, decision) if s.online)
    raise preflight_error(decision, found, ever_linked=True, pinned_owned=False, owned_online=online)
