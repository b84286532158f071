"""What one request's route is made of, as the scheduler, the queue, the gates and Self-Route read it:
its policy (public, exclusive self-route, prefer or shared, an optional pinned machine and share), the
shares it may route through, and the ``RouteDecision`` it carries through first dispatch, retries,
the backup and the queue (``routing/route.py`` makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.routing.affinity import Conversation
from darkbloom.wire.catalog import CatalogModel

RouteMode = Literal["public", "exclusive", "prefer", "shared"]


_NEED_NAMES = {"tools": "tools", "structured_output": "structured output (response_format)",
               "logprobs": "logprobs", "completions": "legacy completions",
               "completion_batches": "a list of prompts in one request", "embeddings": "embeddings",
               "images": "images"}


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


@dataclass(frozen=True)
class ShareGrant:
    """A share as a request routes and bills by it: whose machines, which ones, at what price."""

    id: str
    owner_account_id: str
    machine_ids: frozenset[str] | None      # None: all the owner's machines
    input_price: int
    output_price: int
    daily_request_limit: int | None
    daily_token_limit: int | None

    @property
    def priced(self) -> bool:
        return bool(self.input_price or self.output_price)

    def covers(self, session: ProviderSession) -> bool:
        return session.account_id == self.owner_account_id and (
            self.machine_ids is None or session.machine_id in self.machine_ids)

    def priced_model(self, model: CatalogModel) -> CatalogModel:
        """The model at this share's prices (what a request through it is charged)."""
        return CatalogModel(id=model.id, input_price=self.input_price, output_price=self.output_price)

    def as_row(self) -> dict[str, object]:
        return {"id": self.id, "daily_request_limit": self.daily_request_limit,
                "daily_token_limit": self.daily_token_limit}


@dataclass
class RouteDecision:
    model: CatalogModel
    needs: frozenset[str] = frozenset()    # capabilities the request needs beyond plain chat (CAPABILITIES)
    owner_account_id: str | None = None   # self-route: the caller's account, whose sessions are "owned"
    owned_only: bool = False              # exclusive self-route: never the public fleet
    pinned: str | None = None             # an owned mach_… or prov_… id (exclusive only)
    excluded: set[str] = field(default_factory=set)  # sessions that already failed this request
    context_needed: int = 0               # tokens of context the request may take (0: not checked)
    output_tokens: int = 0                # the most tokens its answer may take (0: not known)
    # shared routing (docs/sharing.md): the shares whose machines it may use after the owner's own,
    # and those it may not because today's allowance is used up
    shares: tuple[ShareGrant, ...] = ()
    exhausted_shares: tuple[ShareGrant, ...] = ()
    shared_routing: bool = False          # X-Darkbloom-Route: shared (its own pre-flight errors)
    tallied: bool = False                 # counted by its model's public view (machine insight), once
    affinity: str | None = None           # the session that served its conversation before (routing/affinity.py)
    conversation: Conversation | None = None  # remembered with the session that serves it, for its next turn
    batch: bool = False                   # a batch line: the lowest priority, and it leaves slots free for live requests

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model.id, *self.model.aliases)

    def needs_in_words(self) -> str:
        """The request's capabilities, for the errors that name them."""
        return " and ".join(_NEED_NAMES.get(need, need) for need in sorted(self.needs)) or "this request"

    def owns(self, session: ProviderSession) -> bool:
        return self.owner_account_id is not None and session.account_id == self.owner_account_id

    def granted(self, session: ProviderSession) -> Optional[ShareGrant]:
        """The first (cheapest) of the request's shares that covers the session, if any."""
        return next((grant for grant in self.shares if grant.covers(session)), None)

    def may_use(self, session: ProviderSession) -> bool:
        """Owned, or shared with the caller: what relaxes the trust floor and private_only."""
        return self.owns(session) or (bool(self.shares) and self.granted(session) is not None)

    @property
    def share_owners(self) -> tuple[str, ...]:
        """The accounts whose machines the shares cover, in the shares' order, each once."""
        return tuple(dict.fromkeys(grant.owner_account_id for grant in self.shares))

    def only_through(self, grant: ShareGrant) -> None:
        """Admitted on this share: retries and the backup may use the caller's own machines and this
        share's, no other share (whose allowance the request did not take)."""
        self.shares = (grant,)

    def exhaust(self, grant: ShareGrant) -> None:
        """The share's allowance for today ran out while the request was being placed."""
        self.shares = tuple(g for g in self.shares if g.id != grant.id)
        self.exhausted_shares = (*self.exhausted_shares, grant)
