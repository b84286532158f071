"""Shortcuts the billing tests use on the real billing functions."""

from __future__ import annotations

from darkbloom.coordinator.money import billing
from darkbloom.coordinator.services import Services
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.protocol import Usage


async def settle_paid(services: Services, reservation: billing.Reservation, model: CatalogModel, usage: Usage,
                      served: billing.Served) -> billing.Settlement | None:
    """Settle a plain paid request (one that did not ask for the caller's own machine)."""
    bill = billing.Bill(reservation.request_id, reservation.account_id, reservation.key_id, model, reservation,
                        self_routed=False)
    return await billing.settle_bill(services, bill, usage, served)
