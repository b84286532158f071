"""Route policy (docs/self-route.md "Three ways to ask for your own machine"): public, exclusive self-route or
prefer, and an optional pinned machine.

The policy comes only from server-side facts: the ``X-Darkbloom-Route`` header (a request, never
a body field), the API key's ``self_route_only`` ceiling and the authenticated account. The
header can ask for self-routing; it can never name an owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from starlette.datastructures import Headers

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.wire.openai.errors import ApiError, invalid_request

RouteMode = Literal["public", "exclusive", "prefer"]
ROUTE_HEADER = "x-darkbloom-route"
MACHINE_HEADER = "x-darkbloom-machine"
MAX_MACHINE_ID = 256


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
