"""The routing decision one request carries through first dispatch, retries, the backup and the queue."""

from __future__ import annotations

from dataclasses import dataclass, field

from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire.catalog import CatalogModel


_NEED_NAMES = {"tools": "tools", "structured_output": "structured output (response_format)",
               "logprobs": "logprobs", "completions": "legacy completions", "embeddings": "embeddings",
               "images": "images"}


@dataclass
class RouteDecision:
    model: CatalogModel
    needs: frozenset[str] = frozenset()    # capabilities the request needs beyond plain chat (CAPABILITIES)
    owner_account_id: str | None = None   # self-route: the caller's account, whose sessions are "owned"
    owned_only: bool = False              # exclusive self-route: never the public fleet
    pinned: str | None = None             # an owned mach_… or prov_… id (exclusive only)
    excluded: set[str] = field(default_factory=set)  # sessions that already failed this request
    context_needed: int = 0               # tokens of context the request may take (0: not checked)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model.id, *self.model.aliases)

    def needs_in_words(self) -> str:
        """The request's capabilities, for the errors that name them."""
        return " and ".join(_NEED_NAMES.get(need, need) for need in sorted(self.needs)) or "this request"

    def owns(self, session: ProviderSession) -> bool:
        return self.owner_account_id is not None and session.account_id == self.owner_account_id
