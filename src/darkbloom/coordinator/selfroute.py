"""Self-Route policy and pre-flight (CONTRACT §4): "use my own machine, for free".

The policy comes only from server-side facts: the ``X-Darkbloom-Route`` header (a request, never
a body field), the API key's ``self_route_only`` ceiling and the authenticated account. The
header can ask for self-routing; it can never name an owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from starlette.datastructures import Headers

from darkbloom.coordinator.auth import Caller
from darkbloom.coordinator.errors import ApiError, invalid_request
from darkbloom.coordinator.scheduler import PRIVACY_GATES, RouteDecision, Survey
from darkbloom.coordinator.services import Services
from darkbloom.store import machines

RouteMode = Literal["public", "exclusive", "prefer"]
ROUTE_HEADER = "x-darkbloom-route"
MACHINE_HEADER = "x-darkbloom-machine"
MAX_MACHINE_ID = 256

_BLOCKER_SENTENCES = {
    "runtime_not_verified": "its Darkbloom runtime is not a verified release (update the node to this release)",
    "no_encrypted_chunks": "it cannot encrypt its responses (update the node)",
    "challenge_stale": "it has not passed a recent attestation challenge (restart the node)",
    "untrusted": "it failed an integrity check (restart the node; if it persists, reinstall it)",
}


@dataclass(frozen=True)
class Policy:
    mode: RouteMode
    owner_account_id: str | None
    pinned: str | None = None

    @property
    def exclusive(self) -> bool:
        return self.mode == "exclusive"

    @property
    def self_routed(self) -> bool:
        return self.mode != "public"


def resolve_policy(headers: Headers, caller: Caller, *, with_pin: bool = True) -> Policy:
    """Header intent, capped by the key's ``self_route_only``; the owner is always the caller."""
    values = headers.getlist(ROUTE_HEADER)
    first = values[0].split(",")[0].strip().lower() if values else ""
    mode: RouteMode = "exclusive" if first == "self" else "prefer" if first == "prefer" else "public"
    if caller.key and caller.key.get("self_route_only"):
        mode = "exclusive"
    pinned = _pinned(headers, mode) if with_pin else None
    return Policy(mode, caller.account_id if mode != "public" else None, pinned)


def _pinned(headers: Headers, mode: RouteMode) -> str | None:
    values = headers.getlist(MACHINE_HEADER)
    if not values:
        return None

    def bad(why: str) -> ApiError:
        return invalid_request(f"X-Darkbloom-Machine {why}.", param="X-Darkbloom-Machine")

    if mode != "exclusive":
        raise bad("only works with an exclusive self-route request (X-Darkbloom-Route: self or a "
                  "self_route_only key)")
    if len(values) > 1:
        raise bad("must be sent once")
    value = values[0].strip()
    if not value:
        raise bad("must not be blank")
    if "," in value:
        raise bad("names one machine: no commas")
    if len(value) > MAX_MACHINE_ID:
        raise bad(f"must be at most {MAX_MACHINE_ID} characters")
    return value


def machine_not_found() -> ApiError:
    return ApiError(404, "machine_not_found",
                    "No machine with this id is linked to your account. GET /v1/me/providers lists yours.")


def machine_offline(pinned: bool) -> ApiError:
    which = "That machine is" if pinned else "Your machine is"
    return ApiError(503, "machine_offline",
                    f"{which} offline — start your Darkbloom node (`darkbloom serve`) and retry.",
                    headers={"Retry-After": "30"})


def no_linked_machine() -> ApiError:
    return ApiError(409, "no_linked_machine",
                    "No machine is linked to your account. Run `darkbloom login` on your machine to link it, "
                    "then `darkbloom serve`.")


def model_not_loaded(model: str) -> ApiError:
    return ApiError(503, "model_not_loaded",
                    f"Your machine is online but does not serve '{model}'. Start your node with "
                    f"`darkbloom serve --model {model}` or pick a model it serves (GET /v1/me/self-route-models).",
                    headers={"Retry-After": "15"})


def machine_busy(retry_after: int) -> ApiError:
    return ApiError(429, "machine_busy",
                    f"Your machine is busy with other requests. Retry in {retry_after} s, or raise its "
                    "max_concurrency.", headers={"Retry-After": str(max(1, retry_after))})


def preflight_error(decision: RouteDecision, found: Survey, *, ever_linked: bool, pinned_owned: bool,
                    owned_online: int) -> ApiError:
    """Why an exclusive request cannot be served, in the order of the CONTRACT §4 table."""
    if decision.pinned and not pinned_owned:
        return machine_not_found()
    if decision.pinned and owned_online == 0:
        return machine_offline(pinned=True)
    if not ever_linked:
        return no_linked_machine()
    if owned_online == 0:
        return machine_offline(pinned=False)
    reasons = found.reasons
    if reasons.get("capability_unsupported"):
        return ApiError(503, "model_unavailable",
                        f"Your machine serves '{decision.model.id}' but not for this kind of request "
                        "(images or tools). Send a plain text request or load a model that supports it.",
                        code="model_capability_unsupported")
    blockers = [reason for reason in ("untrusted", *sorted(PRIVACY_GATES)) if reasons.get(reason)]
    if blockers:
        why = "; ".join(_BLOCKER_SENTENCES[b] for b in blockers)
        return ApiError(503, "model_routing_blocked",
                        f"Your machine serves '{decision.model.id}' but cannot be used privately right now: {why}.")
    return model_not_loaded(decision.model.id)


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
