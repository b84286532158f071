"""Prices → cost, reservation, settlement and refund. Each step goes through the process's ledger
writer (``services.ledger``: group commit, see ``ledger.writer``), is atomic, and is keyed by the
request id, so a repeated step (duplicate completion, retry, crash) is a no-op.

Ledger view of a paid request: ``reservation −R`` at admission; at settlement ``refund +R`` and
``charge −C`` on the caller, ``platform_fee +F`` to the platform and ``payout +(C−F)`` to the
serving provider's owner (the platform when the provider is unowned), both as withdrawable.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from darkbloom.coordinator.identity.api_keys import ApiKey
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.money.ledger import rules
from darkbloom.coordinator.money.ledger.writer import LedgerUnavailable
from darkbloom.coordinator.services import Services
from darkbloom.store import ledger as ledger_store
from darkbloom.wire.protocol import Usage

log = logging.getLogger("darkbloom.billing")


@dataclass(frozen=True)
class Reservation:
    request_id: str
    account_id: str
    key_id: str | None
    amount: int
    window_start: int | None


@dataclass(frozen=True)
class Served:
    """Who actually served a request, read from the serving session object."""

    provider_id: str
    provider_account_id: str | None
    machine_id: str | None = None


@dataclass(frozen=True)
class Settlement:
    cost: int
    platform_fee: int
    payout: int


def spend_window_start(reset: str, now: datetime | None = None) -> int:
    """Start (Unix seconds, UTC) of the key's current spend-cap window."""
    now = now or datetime.now(timezone.utc)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if reset == "daily":
        start = midnight
    elif reset == "weekly":
        start = midnight - timedelta(days=midnight.weekday())
    elif reset == "monthly":
        start = midnight.replace(day=1)
    else:
        return 0
    return int(start.timestamp())


def _minimum(model: CatalogModel, min_charge: int) -> int:
    """The minimum charge applies to priced models; a model priced 0/0 is free."""
    return min_charge if model.input_price or model.output_price else 0


FULL_PRICE_BPS = 10_000


def charge_for(model: CatalogModel, usage: Usage, min_charge: int, price_bps: int = FULL_PRICE_BPS) -> int:
    """What ``usage`` costs at ``model``'s prices × ``price_bps`` / 10,000 (a batch's discount), and at
    least the minimum charge."""
    return max(_minimum(model, min_charge),
               model.cost(usage.prompt_tokens, usage.completion_tokens) * price_bps // FULL_PRICE_BPS)


def worst_case(model: CatalogModel, prompt_tokens: int, output_bound: int, min_charge: int,
               price_bps: int = FULL_PRICE_BPS) -> int:
    return max(_minimum(model, min_charge), model.cost(prompt_tokens, output_bound) * price_bps // FULL_PRICE_BPS)


async def reserve(services: Services, request_id: str, account_id: str, key: ApiKey | None,
                  amount: int, *, prefer: bool = False) -> Reservation:
    """Hold ``amount`` against the key's cap (and, for a prefer request, its fallback budget) and debit
    it from the balance, atomically, or raise 402 — or ``FallbackExhausted`` when the fallback budget
    cannot hold it (nothing taken: the request goes as exclusive, docs/self-route.md "Fallback budget").
    Returns once the reservation is committed (the request may then be dispatched)."""
    cap = key.limit_micro_usd if key else None
    window = spend_window_start(key.limit_reset) if key and cap is not None else None
    fallback_cap = key.fallback_limit_micro_usd if key and prefer else None
    fallback_window = spend_window_start(key.fallback_limit_reset) if key and fallback_cap is not None else None
    key_id = key.id if key else None
    step = rules.Reserve(request_id, account_id, key_id, amount, cap, window,
                         services.instance_id, fallback_cap, fallback_window)
    future = services.ledger.submit(step)
    try:
        result = await asyncio.shield(future)
    except asyncio.CancelledError:  # the caller went away: a hold that commits anyway is given back
        future.add_done_callback(lambda done: _refund_orphan(services, request_id, done))
        raise
    except LedgerUnavailable:
        log.exception("request %s: the reservation could not be written", request_id)
        raise ApiError(503, "service_unavailable", "Billing is temporarily unavailable; retry in a few seconds.",
                       headers={"Retry-After": "5"}) from None
    if result == rules.FALLBACK_EXHAUSTED:
        raise FallbackExhausted(request_id)
    if result == rules.SPEND_CAP_EXCEEDED:
        raise ApiError(402, "spend_cap_exceeded",
                       "This API key has reached its spend limit for the current period. Raise the key's "
                       "limit or wait for it to reset.")
    if result == rules.INSUFFICIENT_FUNDS:
        raise ApiError(402, "insufficient_funds",
                       f"Your balance cannot cover this request (it needs up to {amount} µUSD). "
                       "Add credit, or lower max_tokens.", code="insufficient_quota")
    if result == rules.DUPLICATE:
        raise DuplicateReservation(f"request {request_id} already has a reservation")
    return Reservation(request_id, account_id, key_id, amount, window)


class DuplicateReservation(Exception):
    """A request id that already has a (different) reservation: ids are unique per request."""


class FallbackExhausted(Exception):
    """A prefer request whose key's fallback budget cannot hold its worst case this window: nothing was
    reserved, and it is served as exclusive self-route (own machines only, $0)."""


def _refund_orphan(services: Services, request_id: str, done: asyncio.Future[Any]) -> None:
    if done.cancelled() or done.exception() is not None or done.result() != rules.RESERVED:
        return
    log.info("request %s: its caller went away while the reservation committed; refunding it", request_id)
    try:
        services.ledger.submit(rules.Refund(request_id)).add_done_callback(_log_failure(request_id))
    except LedgerUnavailable:
        log.error("request %s: reservation left open (the ledger writer is closed); the reconciler of the "
                  "next start refunds it", request_id)


def _log_failure(request_id: str) -> Callable[[asyncio.Future[Any]], None]:
    def check(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("request %s: refund failed: %r", request_id, done.exception())
    return check


@dataclass(frozen=True)
class ShareTerms:
    """The share a request was admitted on (docs/sharing.md "Money"): its owner and its prices."""

    share_id: str
    owner_account_id: str
    priced_model: CatalogModel   # the request's model at the share's prices (0 and 0: free)


@dataclass(frozen=True)
class BatchTerms:
    """A batch line's request: on the fleet it costs the live price × ``fleet_price_bps`` / 10,000
    (the coordinator's batch discount, before the minimum charge); its usage row names its batch and line."""

    batch_id: str
    custom_id: str
    fleet_price_bps: int


@dataclass(frozen=True)
class Bill:
    """What settlement needs to know about a request, decided at admission."""

    request_id: str
    account_id: str
    key_id: str | None
    model: CatalogModel
    reservation: Reservation | None  # None for exclusive self-route
    self_routed: bool                # the caller asked for their own machine (exclusive or prefer)
    exclusive: bool = False          # exclusive self-route: $0 whoever owns the machine by the end
    share: ShareTerms | None = None  # shared routing: admitted on this share
    batch: BatchTerms | None = None  # a batch line


async def settle_bill(services: Services, bill: Bill, usage: Usage, served: Served) -> Settlement | None:
    """Settle a completed request once (None if it was settled or refunded before). Free only when
    the caller asked for their own machine and the session that actually served belongs to them
    (re-read from that session object); otherwise paid: from the reservation when there is one,
    else straight from the balance — and when that charge cannot be collected, nobody is paid.
    An exclusive request (no reservation) writes its usage row through the same writer."""
    settings = services.settings
    owned = served.provider_account_id == bill.account_id
    share = None if owned else bill.share
    routed, share_id, price = ("owned" if owned else "fleet"), None, bill.model
    if share is not None:
        # re-checked from the serving session's owner: a share revoked or expired in flight still settles at
        # its own terms; a machine that changed owner mid-flight is free and pays nobody (never the fleet price)
        routed, share_id = "shared", share.share_id
        price = share.priced_model if served.provider_account_id == share.owner_account_id else None
    # exclusive guarantees $0 (docs/self-route.md "Billing"): a machine unlinked mid-flight makes it no one's own,
    # but the request still costs nothing and pays nobody, and its usage row says why
    ownership_changed = (bill.exclusive and not owned and share is None) or (share is not None and price is None)
    free = (bill.self_routed and owned) or (bill.exclusive and share is None) or price is None
    reservation = bill.reservation
    price_bps = bill.batch.fleet_price_bps if bill.batch is not None and routed == "fleet" else FULL_PRICE_BPS
    cost = 0 if free else charge_for(price, usage, settings.min_charge_micro_usd, price_bps)  # type: ignore[arg-type]
    if reservation is not None and cost > reservation.amount:
        log.warning("request %s: reported usage costs %d µUSD, above its reservation %d; charging the reservation",
                    bill.request_id, cost, reservation.amount)
        cost = reservation.amount
    result = await services.ledger.run(rules.Settle(
        bill.request_id, bill.account_id, bill.key_id, bill.model.id, served.provider_id,
        served.provider_account_id, usage.prompt_tokens, usage.completion_tokens, cost, settings.platform_fee_bps,
        reserved=reservation is not None, self_routed=free and share is None, routed=routed,
        ownership_changed=ownership_changed, share_id=share_id, machine_id=served.machine_id,
        batch_id=bill.batch.batch_id if bill.batch else None, custom_id=bill.batch.custom_id if bill.batch else None))
    if result is None:
        return None
    if result.uncollected:
        log.warning("request %s: served by a machine the caller does not own and the charge of %d µUSD "
                    "cannot be collected; the provider is not paid", bill.request_id, result.uncollected)
    return Settlement(result.cost, result.platform_fee, result.payout)


async def charged(services: Services, request_id: str) -> int:
    """What a settled request charged, read back from its usage row (0: it has none, nothing was charged)."""
    async with services.engine.connect() as conn:
        return await ledger_store.charged_for(conn, request_id) or 0


async def refund(services: Services, reservation: Reservation) -> bool:
    """Return the whole reservation (failure, or nothing reported in time). False if already closed."""
    return await refund_request(services, reservation.request_id)


async def refund_request(services: Services, request_id: str) -> bool:
    return bool(await services.ledger.run(rules.Refund(request_id)))
