"""Shortcuts the billing tests use on the real billing functions, and the ledger's invariant."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from darkbloom.coordinator.money import billing
from darkbloom.coordinator.services import Services
from darkbloom.wire.catalog import CatalogModel
from darkbloom.store.schema import PLATFORM_ACCOUNT_ID, accounts, admin_credits, ledger_entries, reservations
from darkbloom.wire.protocol import Usage


async def settle_paid(services: Services, reservation: billing.Reservation, model: CatalogModel, usage: Usage,
                      served: billing.Served) -> billing.Settlement | None:
    """Settle a plain paid request (one that did not ask for the caller's own machine)."""
    bill = billing.Bill(reservation.request_id, reservation.account_id, reservation.key_id, model, reservation,
                        self_routed=False)
    return await billing.settle_bill(services, bill, usage, served)


async def check_ledger_consistency(engine: Any) -> None:
    """Every account's pockets equal the sum of their ledger entries, each entry's ``balance_after``
    is the running sum, no pocket is negative, and the money in the system (pockets plus open
    reservations) is what was credited."""
    async with engine.connect() as conn:
        account_rows = [dict(r) for r in (await conn.execute(select(accounts))).mappings()]
        entries = [dict(r) for r in (await conn.execute(
            select(ledger_entries).order_by(ledger_entries.c.id))).mappings()]
        credited = int((await conn.execute(
            select(func.coalesce(func.sum(admin_credits.c.amount_micro_usd), 0)))).scalar() or 0)
        held = int((await conn.execute(select(func.coalesce(func.sum(reservations.c.amount_micro_usd), 0))
                                       .where(reservations.c.status == "open"))).scalar() or 0)
    running: dict[tuple[str, str], int] = {}
    for entry in entries:
        key = (entry["account_id"], entry["pocket"])
        running[key] = running.get(key, 0) + int(entry["amount_micro_usd"])
        assert int(entry["balance_after"]) == running[key], entry
    total = 0
    for account in account_rows:
        balance, withdrawable = int(account["balance_micro_usd"]), int(account["withdrawable_micro_usd"])
        assert balance >= 0 and withdrawable >= 0, account
        assert running.get((account["id"], "balance"), 0) == balance, account
        assert running.get((account["id"], "withdrawable"), 0) == withdrawable, account
        total += balance + withdrawable
    assert total + held == credited
    assert any(a["id"] == PLATFORM_ACCOUNT_ID for a in account_rows)
