"""A key's fallback budget (docs/billing.md "Fallback budget"): what prefer requests on the key may
spend on the public fleet per window, held at reservation time in the same ledger batch as the
spend cap, so concurrent requests — on one coordinator or several — never pass it. A prefer request
the budget cannot hold reserves nothing (``FallbackExhausted``: it goes as exclusive)."""

from __future__ import annotations

import asyncio

import pytest

from darkbloom.coordinator.money import billing
from darkbloom.coordinator.money.ledger.rules import fallback_scope
from darkbloom.coordinator.services import Services
from darkbloom.store.schema import reservations
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.protocol import Usage

from tests.coordinator.money.conftest import PRICED, MakeServices, counts, new_account, new_key, pockets, rows
from tests.support.money import check_ledger_consistency
from tests.support.store_queries import key_window_spend

WORST = 1_000
N = 7  # the budget holds this many requests' worst case


def _bill(reservation: billing.Reservation, key_id: str) -> billing.Bill:
    return billing.Bill(reservation.request_id, reservation.account_id, key_id, PRICED, reservation,
                        self_routed=True)


async def _fallback_window(services: Services, key_id: str) -> tuple[int, int]:
    async with services.engine.connect() as conn:
        return await key_window_spend(conn, fallback_scope(key_id), 0)


async def test_the_budget_holds_only_prefer_requests_and_refuses_without_a_trace(services: Services) -> None:
    account = await new_account(services, credit=100_000)
    key = await new_key(services, account, fallback_limit_micro_usd=2 * WORST)
    await billing.reserve(services, "plain", account, key, WORST)  # a public request: not the fallback budget
    assert await _fallback_window(services, key.id) == (0, 0)
    held = await billing.reserve(services, "p1", account, key, WORST, prefer=True)
    await billing.reserve(services, "p2", account, key, WORST, prefer=True)
    assert await _fallback_window(services, key.id) == (0, 2 * WORST)
    before = await counts(services.engine)
    with pytest.raises(billing.FallbackExhausted):
        await billing.reserve(services, "p3", account, key, 1, prefer=True)
    assert await counts(services.engine) == before
    assert await pockets(services, account) == (100_000 - 3 * WORST, 0)
    # served by the caller's own machine: free, and the budget is whole again
    owned = billing.Served("prov_mine", account)
    await billing.settle_bill(services, _bill(held, key.id), Usage(prompt_tokens=5, completion_tokens=5), owned)
    assert await _fallback_window(services, key.id) == (0, WORST)
    [row] = await rows(services, reservations, reservations.c.request_id == "p1")
    assert row["fallback_window_start"] == 0 and row["status"] == "settled"
    await billing.reserve(services, "p4", account, key, WORST, prefer=True)


async def test_a_budget_used_on_the_fleet_stays_used_and_the_spend_cap_still_applies(services: Services) -> None:
    account = await new_account(services, credit=100_000)
    key = await new_key(services, account, fallback_limit_micro_usd=10 * WORST, limit_micro_usd=3 * WORST)
    held = await billing.reserve(services, "f1", account, key, 2 * WORST, prefer=True)
    fleet = billing.Served("prov_public", None)
    settled = await billing.settle_bill(services, _bill(held, key.id),
                                        Usage(prompt_tokens=100, completion_tokens=100), fleet)
    assert settled is not None and 0 < settled.cost <= 2 * WORST
    assert await _fallback_window(services, key.id) == (settled.cost, 0)
    # the spend cap is checked after the fallback budget: 402, and nothing taken from either
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, "f2", account, key, 3 * WORST, prefer=True)
    assert caught.value.type == "spend_cap_exceeded"
    assert await _fallback_window(services, key.id) == (settled.cost, 0)
    # a refund gives the hold back to both windows
    again = await billing.reserve(services, "f3", account, key, WORST, prefer=True)
    assert await billing.refund(services, again)
    assert await _fallback_window(services, key.id) == (settled.cost, 0)


async def test_a_zero_budget_refuses_every_fallback_and_an_unfunded_owner_is_not_402(services: Services) -> None:
    account = await new_account(services, credit=0)
    key = await new_key(services, account, fallback_limit_micro_usd=0)
    with pytest.raises(billing.FallbackExhausted):  # the budget first: the request goes as exclusive, free
        await billing.reserve(services, "z1", account, key, WORST, prefer=True)


@pytest.mark.parametrize("coordinators", [1, 2])
async def test_200_concurrent_prefer_reservations_never_pass_the_budget(make_services: MakeServices,
                                                                       coordinators: int) -> None:
    """200 prefer requests at once, on one coordinator or split over two (two ledger writers, each
    batching, racing on the same window row): exactly N are held, every other one reserves nothing,
    and after all of them settle on the fleet at their worst case the window's spend is N × WORST."""
    fleet = [await make_services() for _ in range(coordinators)]
    account = await new_account(fleet[0], credit=10_000_000)
    key = await new_key(fleet[0], account, fallback_limit_micro_usd=N * WORST, fallback_limit_reset="daily")

    async def prefer(i: int) -> billing.Reservation | None:
        try:
            return await billing.reserve(fleet[i % coordinators], f"race-{i}", account, key, WORST, prefer=True)
        except billing.FallbackExhausted:
            return None

    results = await asyncio.gather(*(prefer(i) for i in range(200)))
    held = [r for r in results if r is not None]
    assert len(held) == N
    window = billing.spend_window_start("daily")
    async with fleet[0].engine.connect() as conn:
        assert await key_window_spend(conn, fallback_scope(key.id), window) == (0, N * WORST)
    usage = Usage(prompt_tokens=10**6, completion_tokens=10**6)  # costs more than the hold: charged the hold
    charged = 0
    for reservation in held:
        settled = await billing.settle_bill(fleet[0], _bill(reservation, key.id), usage,
                                            billing.Served("prov_public", None))
        assert settled is not None
        charged += settled.cost
    assert charged == N * WORST
    async with fleet[0].engine.connect() as conn:
        assert await key_window_spend(conn, fallback_scope(key.id), window) == (N * WORST, 0)
    assert await pockets(fleet[0], account) == (10_000_000 - N * WORST, 0)
    await check_ledger_consistency(fleet[0].engine)
