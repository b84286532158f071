"""Prices → cost, reservation, settlement and refund. Each step is one database transaction and
is keyed by the request id, so a repeated step (duplicate completion, retry, crash) is a no-op.

Ledger view of a paid request: ``reservation −R`` at admission; at settlement ``refund +R`` and
``charge −C`` on the caller, ``platform_fee +F`` to the platform and ``payout +(C−F)`` to the
serving provider's owner (the platform when the provider is unowned), both as withdrawable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.services import Services
from darkbloom.wire.protocol import Usage
from darkbloom.store import ledger
from darkbloom.store.schema import PLATFORM_ACCOUNT_ID

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


def charge_for(model: CatalogModel, usage: Usage, min_charge: int) -> int:
    return max(_minimum(model, min_charge), model.cost(usage.prompt_tokens, usage.completion_tokens))


def worst_case(model: CatalogModel, prompt_tokens: int, output_bound: int, min_charge: int) -> int:
    return max(_minimum(model, min_charge), model.cost(prompt_tokens, output_bound))


async def reserve(services: Services, request_id: str, account_id: str, key: dict[str, Any] | None,
                  amount: int) -> Reservation:
    """Hold ``amount`` against the key's cap and debit it from the balance, atomically, or raise 402."""
    cap = key.get("limit_micro_usd") if key else None
    window = spend_window_start(key["limit_reset"]) if key and cap is not None else None
    async with services.engine.begin() as conn:
        if key is not None and cap is not None and window is not None:
            if not await ledger.reserve_key_spend(conn, key["id"], window, int(cap), amount):
                raise ApiError(402, "spend_cap_exceeded",
                               "This API key has reached its spend limit for the current period. Raise the key's "
                               "limit or wait for it to reset.")
        if await ledger.move(conn, account_id, "balance", -amount, "reservation", request_id=request_id,
                             require_funds=True) is None:
            raise ApiError(402, "insufficient_funds",
                           f"Your balance cannot cover this request (it needs up to {amount} µUSD). "
                           "Add credit, or lower max_tokens.", code="insufficient_quota")
        await ledger.open_reservation(conn, request_id, account_id, key["id"] if key else None, amount, window,
                                      services.instance_id)
    return Reservation(request_id, account_id, key["id"] if key else None, amount, window)


@dataclass(frozen=True)
class Bill:
    """What settlement needs to know about a request, decided at admission."""

    request_id: str
    account_id: str
    key_id: str | None
    model: CatalogModel
    reservation: Reservation | None  # None for exclusive self-route
    self_routed: bool                # the caller asked for their own machine (exclusive or prefer)


class _AlreadySettled(Exception):
    pass


async def settle_bill(services: Services, bill: Bill, usage: Usage, served: Served) -> Settlement | None:
    """Settle a completed request once. Free only when the caller asked for their own machine and
    the session that actually served belongs to them (re-read from that session object);
    otherwise paid: from the reservation when there is one, else straight from the balance —
    and when that charge cannot be collected, nobody is paid."""
    settings = services.settings
    owned = served.provider_account_id == bill.account_id
    free = bill.self_routed and owned
    reservation = bill.reservation
    cost = 0 if free else charge_for(bill.model, usage, settings.min_charge_micro_usd)
    if reservation is not None and cost > reservation.amount:
        log.warning("request %s: reported usage costs %d µUSD, above its reservation %d; charging the reservation",
                    bill.request_id, cost, reservation.amount)
        cost = reservation.amount
    payee = served.provider_account_id or PLATFORM_ACCOUNT_ID
    request_id = bill.request_id
    try:
        async with services.engine.begin() as conn:
            # locks in the global order (see ledger.lock_accounts): reservation, key window, accounts by id
            if reservation is not None:
                if await ledger.close_reservation(conn, request_id, "settled") is None:
                    return None
                if reservation.key_id and reservation.window_start is not None:
                    await ledger.release_key_spend(conn, reservation.key_id, reservation.window_start,
                                                   reserved=reservation.amount, spent=cost)
            await ledger.lock_accounts(conn, {bill.account_id, PLATFORM_ACCOUNT_ID, payee})
            collected = cost
            if reservation is not None:
                await ledger.move(conn, bill.account_id, "balance", reservation.amount, "refund",
                                  request_id=request_id)
                if cost:
                    await ledger.move(conn, bill.account_id, "balance", -cost, "charge", request_id=request_id)
            elif cost and await ledger.move(conn, bill.account_id, "balance", -cost, "charge",
                                            request_id=request_id, require_funds=True) is None:
                log.warning("request %s: served by a machine the caller does not own and the charge of %d µUSD "
                            "cannot be collected; the provider is not paid", request_id, cost)
                collected = 0
            fee = collected * settings.platform_fee_bps // 10_000
            payout = collected - fee
            if fee:
                await ledger.move(conn, PLATFORM_ACCOUNT_ID, "withdrawable", fee, "platform_fee", request_id=request_id)
            if payout:
                await ledger.move(conn, payee, "withdrawable", payout, "payout", request_id=request_id)
            if not await ledger.record_usage(
                    conn, request_id=request_id, account_id=bill.account_id, key_id=bill.key_id,
                    model=bill.model.id, provider_id=served.provider_id,
                    provider_account_id=served.provider_account_id, prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens, cost_micro_usd=collected,
                    platform_fee_micro_usd=fee, provider_payout_micro_usd=payout, self_routed=free,
                    routed="owned" if owned else "fleet"):
                raise _AlreadySettled()
    except _AlreadySettled:
        return None
    return Settlement(collected, fee, payout)


async def refund(services: Services, reservation: Reservation) -> bool:
    """Return the whole reservation (failure, or nothing reported in time). False if already closed."""
    async with services.engine.begin() as conn:
        return await refund_in(conn, reservation.request_id)


async def refund_in(conn: Any, request_id: str) -> bool:
    row = await ledger.close_reservation(conn, request_id, "refunded")
    if row is None:
        return False
    # the key's window before the account: the lock order of reserve and settle (see ledger.lock_accounts)
    if row["key_id"] and row["window_start"] is not None:
        await ledger.release_key_spend(conn, row["key_id"], int(row["window_start"]),
                                       reserved=int(row["amount_micro_usd"]), spent=0)
    await ledger.move(conn, row["account_id"], "balance", int(row["amount_micro_usd"]), "refund",
                      request_id=request_id)
    return True
