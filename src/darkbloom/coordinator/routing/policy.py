"""Route policy (docs/self-route.md "Three ways to ask for your own machine", docs/sharing.md): public,
exclusive self-route, prefer or shared, an optional pinned machine and an optional share.

The policy comes only from server-side facts: the ``X-Darkbloom-Route`` header (a request, never
a body field), the API key's ``self_route_only`` and ``shared_only`` ceilings and the authenticated
account. The header can ask for self-routing; it can never name an owner (a share it names must
be one the caller received).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from starlette.datastructures import Headers

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.wire.openai.errors import ApiError, invalid_request

RouteMode = Literal["public", "exclusive", "prefer", "shared"]
ROUTE_HEADER = "x-darkbloom-route"
MACHINE_HEADER = "x-darkbloom-machine"
SHARE_HEADER = "x-darkbloom-share"
MAX_MACHINE_ID = 256
_MODES: dict[str, RouteMode] = {"self": "exclusive", "prefer": "prefer", "shared": "shared"}


@dataclass(frozen=True)
class Policy:
    mode: RouteMode
    owner_account_id: str | None
    pinned: str | None = None
    share_id: str | None = None  # shared: only this share's machines (and the caller's own)

    @property
    def exclusive(self) -> bool:
        return self.mode == "exclusive"

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    @property
    def never_fleet(self) -> bool:
        """Exclusive or shared: the caller's own machines (and shared ones), never the public fleet."""
        return self.mode in ("exclusive", "shared")

    @property
    def self_routed(self) -> bool:
        return self.mode != "public"


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
