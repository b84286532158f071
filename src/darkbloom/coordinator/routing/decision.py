"""The routing decision one request carries through first dispatch, retries, the backup and the queue."""

from __future__ import annotations

from dataclasses import dataclass, field

from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire.catalog import CatalogModel


@dataclass
class RouteDecision:
    model: CatalogModel
    needs_images: bool = False
    needs_tools: bool = False
    owner_account_id: str | None = None   # self-route: the caller's account, whose sessions are "owned"
    owned_only: bool = False              # exclusive self-route: never the public fleet
    pinned: str | None = None             # an owned mach_… or prov_… id (exclusive only)
    excluded: set[str] = field(default_factory=set)  # sessions that already failed this request

    @property
    def names(self) -> tuple[str, ...]:
        return (self.model.id, *self.model.aliases)

    def owns(self, session: ProviderSession) -> bool:
        return self.owner_account_id is not None and session.account_id == self.owner_account_id
