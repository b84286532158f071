"""billing.settle_bill (via settle_paid) and billing.refund: the cost from usage (docs/billing.md "Money"),
the split, idempotency, and the ledger from which every pocket can be recomputed."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from fractions import Fraction

import pytest

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.money import billing
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.services import Services
from darkbloom.wire.protocol import Usage
from darkbloom.store import accounts
from darkbloom.store.schema import PLATFORM_ACCOUNT_ID, ledger_entries, reservations, usage_records

from tests.coordinator.money.conftest import (PRICED, MakeServices, counts, ledger_for, new_account,
                                    new_key, pockets, rows)
from tests.support.store_queries import key_window_spend, ledger_sum
from tests.support.money import check_ledger_consistency, settle_paid


def expected_cost(model: CatalogModel, prompt: int, completion: int, min_charge: int = 100) -> int:
    """The cost of docs/billing.md "Money", computed independently with exact fractions."""
    raw = (math.ceil(Fraction(prompt * model.input_price, 1_000_000))
           + math.ceil(Fraction(completion * model.output_price, 1_000_000)))
    return max(min_charge, raw)


def served(provider_account_id: str | None, provider_id: str = "prov_abc") -> billing.Served:
    return billing.Served(provider_id=provider_id, provider_account_id=provider_account_id)


@pytest.mark.parametrize(("prompt", "completion"), [(100, 50), (1, 1), (0, 0), (37, 211), (999, 0)])
def test_cost_is_ceiled_per_part_with_a_minimum(prompt: int, completion: int) -> None:
    cost = billing.charge_for(PRICED, Usage(prompt_tokens=prompt, completion_tokens=completion), 100)
    assert cost == expected_cost(PRICED, prompt, completion)


def test_cost_rounds_each_part_up_separately() -> None:
    model = CatalogModel(id="m", input_price=500_000, output_price=500_000)  # half a µUSD per token
    # one prompt token and one completion token: ceil(0.5) + ceil(0.5) = 2, not ceil(1.0) = 1
    assert model.cost(1, 1) == 2
    assert billing.charge_for(model, Usage(prompt_tokens=1, completion_tokens=1), 0) == 2
    assert billing.charge_for(model, Usage(prompt_tokens=1, completion_tokens=1), 100) == 100
    assert billing.worst_case(model, 1, 1, 100) == 100
    assert billing.worst_case(PRICED, 1_000, 256, 100) == expected_cost(PRICED, 1_000, 256)


async def test_settle_charges_refunds_and_splits(make_services: MakeServices) -> None:
    services = await make_services(platform_fee_bps=1_234)
    caller = await new_account(services, credit=50_000)
    owner = await new_account(services)
    key = await new_key(services, caller, limit_micro_usd=20_000)
    held = await billing.reserve(services, "req-s", caller, key, 10_000)
    usage = Usage(prompt_tokens=100, completion_tokens=50)

    settlement = await settle_paid(services, held, PRICED, usage, served(owner))

    cost = expected_cost(PRICED, 100, 50)  # 134 + 234 = 368
    assert cost == 368
    fee = cost * 1_234 // 10_000  # 45.4 → 45
    assert settlement == billing.Settlement(cost=cost, platform_fee=fee, payout=cost - fee)
    assert await pockets(services, caller) == (50_000 - cost, 0)
    assert await pockets(services, owner) == (0, cost - fee)
    assert await pockets(services, PLATFORM_ACCOUNT_ID) == (0, fee)
    [reservation] = await rows(services, reservations, reservations.c.request_id == "req-s")
    assert reservation["status"] == "settled" and reservation["closed_at"] is not None
    [row] = await rows(services, usage_records, usage_records.c.request_id == "req-s")
    assert {k: row[k] for k in ("account_id", "key_id", "model", "provider_id", "provider_account_id",
                                "prompt_tokens", "completion_tokens", "cost_micro_usd", "platform_fee_micro_usd",
                                "provider_payout_micro_usd", "self_routed", "routed")} == {
        "account_id": caller, "key_id": key.id, "model": "priced-model", "provider_id": "prov_abc",
        "provider_account_id": owner, "prompt_tokens": 100, "completion_tokens": 50, "cost_micro_usd": cost,
        "platform_fee_micro_usd": fee, "provider_payout_micro_usd": cost - fee, "self_routed": False,
        "routed": "fleet"}
    entries = [(e["account_id"], e["kind"], e["pocket"], e["amount_micro_usd"]) for e in await ledger_for(services,
                                                                                                           "req-s")]
    assert entries == [(caller, "reservation", "balance", -10_000), (caller, "refund", "balance", 10_000),
                       (caller, "charge", "balance", -cost), (PLATFORM_ACCOUNT_ID, "platform_fee", "withdrawable", fee),
                       (owner, "payout", "withdrawable", cost - fee)]
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (cost, 0)
    await check_ledger_consistency(services.engine)


@pytest.mark.parametrize(("bps", "cost"), [(500, 368), (500, 19_999), (1, 9_999), (1, 10_000), (9_999, 101),
                                           (0, 500), (10_000, 500)])
async def test_fee_rounds_down_and_the_payout_takes_the_rest(make_services: MakeServices, bps: int,
                                                              cost: int) -> None:
    services = await make_services(platform_fee_bps=bps)
    model = CatalogModel(id="per-token", input_price=1_000_000, output_price=0)  # 1 µUSD per prompt token
    caller = await new_account(services, credit=cost)
    owner = await new_account(services)
    held = await billing.reserve(services, f"fee-{bps}-{cost}", caller, None, cost)
    settlement = await settle_paid(services, held, model, Usage(prompt_tokens=cost,
                                                                                completion_tokens=0),
                                      served(owner))
    fee = cost * bps // 10_000
    assert settlement == billing.Settlement(cost, fee, cost - fee)
    assert await pockets(services, caller) == (0, 0)
    assert await pockets(services, owner) == (0, cost - fee)
    assert await pockets(services, PLATFORM_ACCOUNT_ID) == (0, fee)
    kinds = [e["kind"] for e in await ledger_for(services, held.request_id)]
    assert kinds.count("platform_fee") == (1 if fee else 0) and kinds.count("payout") == (1 if cost - fee else 0)
    await check_ledger_consistency(services.engine)


async def test_minimum_charge_applies_to_tiny_requests(make_services: MakeServices) -> None:
    services = await make_services(min_charge_micro_usd=100)
    caller = await new_account(services, credit=1_000)
    held = await billing.reserve(services, "tiny", caller, None, 500)
    settlement = await settle_paid(services, held, PRICED,
                                      Usage(prompt_tokens=3, completion_tokens=2), served(None))
    assert expected_cost(PRICED, 3, 2, min_charge=0) == 14
    assert settlement is not None and settlement.cost == 100
    assert await pockets(services, caller) == (900, 0)
    # even a request that used nothing is charged the minimum when it is settled
    held = await billing.reserve(services, "nothing", caller, None, 500)
    settlement = await settle_paid(services, held, PRICED,
                                      Usage(prompt_tokens=0, completion_tokens=0), served(None))
    assert settlement is not None and settlement.cost == 100


async def test_settled_cost_never_exceeds_the_reservation(services: Services,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caller = await new_account(services, credit=100_000)
    owner = await new_account(services)
    held = await billing.reserve(services, "over", caller, None, 1_000)
    with caplog.at_level(logging.WARNING, logger="darkbloom.billing"):
        settlement = await settle_paid(services, held, PRICED,
                                          Usage(prompt_tokens=5_000, completion_tokens=5_000), served(owner))
    assert settlement is not None and settlement.cost == 1_000
    assert settlement.platform_fee == 1_000 * 500 // 10_000
    assert await pockets(services, caller) == (99_000, 0)
    assert await pockets(services, owner) == (0, 1_000 - settlement.platform_fee)
    assert any("over" in r.getMessage() and "reservation" in r.getMessage() for r in caplog.records)
    [row] = await rows(services, usage_records, usage_records.c.request_id == "over")
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_micro_usd"]) == (5_000, 5_000, 1_000)


async def test_unowned_provider_share_goes_to_the_platform(services: Services) -> None:
    caller = await new_account(services, credit=10_000)
    held = await billing.reserve(services, "unowned", caller, None, 5_000)
    settlement = await settle_paid(services, held, PRICED,
                                      Usage(prompt_tokens=100, completion_tokens=50), served(None))
    assert settlement is not None
    assert await pockets(services, PLATFORM_ACCOUNT_ID) == (0, settlement.cost)
    kinds = [(e["account_id"], e["kind"]) for e in await ledger_for(services, "unowned")]
    assert (PLATFORM_ACCOUNT_ID, "payout") in kinds and (PLATFORM_ACCOUNT_ID, "platform_fee") in kinds
    [row] = await rows(services, usage_records, usage_records.c.request_id == "unowned")
    assert row["provider_account_id"] is None
    await check_ledger_consistency(services.engine)


async def test_second_settlement_is_a_no_op(services: Services) -> None:
    caller = await new_account(services, credit=10_000)
    owner = await new_account(services)
    held = await billing.reserve(services, "twice", caller, None, 5_000)
    usage = Usage(prompt_tokens=100, completion_tokens=50)
    first = await settle_paid(services, held, PRICED, usage, served(owner))
    assert first is not None
    state = (await pockets(services, caller), await pockets(services, owner),
             await pockets(services, PLATFORM_ACCOUNT_ID), await counts(services.engine))
    # the duplicate inference_complete, a retried settlement, a different reported usage: all no-ops
    assert await settle_paid(services, held, PRICED, usage, served(owner)) is None
    assert await settle_paid(services, held, PRICED, Usage(prompt_tokens=1, completion_tokens=1),
                                served(None)) is None
    assert await billing.refund(services, held) is False
    assert state == (await pockets(services, caller), await pockets(services, owner),
                     await pockets(services, PLATFORM_ACCOUNT_ID), await counts(services.engine))
    assert len(await rows(services, usage_records, usage_records.c.request_id == "twice")) == 1


async def test_settle_after_refund_is_a_no_op(services: Services) -> None:
    caller = await new_account(services, credit=10_000)
    owner = await new_account(services)
    key = await new_key(services, caller, limit_micro_usd=6_000)
    held = await billing.reserve(services, "late", caller, key, 5_000)
    assert await billing.refund(services, held) is True
    state = await counts(services.engine)
    assert await settle_paid(services, held, PRICED,
                                Usage(prompt_tokens=100, completion_tokens=50), served(owner)) is None
    assert await counts(services.engine) == state
    assert await pockets(services, caller) == (10_000, 0)
    assert await pockets(services, owner) == (0, 0)
    assert await rows(services, usage_records, usage_records.c.request_id == "late") == []
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (0, 0)


async def test_refund_is_idempotent(services: Services) -> None:
    caller = await new_account(services, credit=10_000)
    key = await new_key(services, caller, limit_micro_usd=6_000, limit_reset="daily")
    held = await billing.reserve(services, "refund-me", caller, key, 4_000)
    assert await billing.refund(services, held) is True
    state = await counts(services.engine)
    assert await billing.refund(services, held) is False
    assert await billing.refund(services, held) is False
    assert await counts(services.engine) == state
    assert await pockets(services, caller) == (10_000, 0)
    [reservation] = await rows(services, reservations, reservations.c.request_id == "refund-me")
    assert reservation["status"] == "refunded"
    entries = [(e["kind"], e["amount_micro_usd"], e["balance_after"]) for e in await ledger_for(services,
                                                                                                "refund-me")]
    assert entries == [("reservation", -4_000, 6_000), ("refund", 4_000, 10_000)]
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, held.window_start or 0) == (0, 0)
    assert await rows(services, usage_records) == []


async def test_refund_of_an_unknown_request_does_nothing(services: Services) -> None:
    state = await counts(services.engine)
    assert await billing.refund(services, billing.Reservation("never", "acct_none", None, 1_000, None)) is False
    assert await counts(services.engine) == state


async def test_ledger_recomputes_every_pocket_after_a_mixed_sequence(make_services: MakeServices) -> None:
    services = await make_services(platform_fee_bps=733)
    rng = random.Random(20240515)
    callers = [await new_account(services, credit=rng.randrange(2_000, 40_000)) for _ in range(3)]
    owners = [await new_account(services) for _ in range(2)] + [None]
    caller_keys = {c: [None, await new_key(services, c, limit_micro_usd=rng.randrange(1_000, 15_000),
                                           limit_reset=rng.choice(["none", "daily", "weekly", "monthly"]))]
                   for c in callers}
    open_: list[billing.Reservation] = []
    refused = 0
    for step in range(120):
        action = rng.random()
        if action < 0.5 or not open_:
            caller = rng.choice(callers)
            try:
                open_.append(await billing.reserve(services, f"mix-{step}", caller, rng.choice(caller_keys[caller]),
                                                   rng.randrange(100, 4_000)))
            except ApiError as error:
                assert error.status == 402
                refused += 1
        elif action < 0.8:
            held = open_.pop(rng.randrange(len(open_)))
            await settle_paid(services, held, PRICED,
                                 Usage(prompt_tokens=rng.randrange(0, 2_000), completion_tokens=rng.randrange(0, 500)),
                                 served(rng.choice(owners)))
        elif action < 0.95:
            await billing.refund(services, open_.pop(rng.randrange(len(open_))))
        else:  # a duplicate completion of something already closed
            assert await billing.refund_request(services, f"mix-{rng.randrange(step)}") in (True, False)
            open_ = [r for r in open_ if (await rows(services, reservations, reservations.c.request_id == r.request_id,
                                                     reservations.c.status == "open"))]
        if step % 30 == 0:
            async with services.engine.begin() as conn:
                await accounts.credit(conn, rng.choice(callers), 1_000, f"top-up-{step}")
                await accounts.credit(conn, rng.choice(callers), 1_000, f"top-up-{step}")  # same reference: once
    assert refused > 0
    await check_ledger_consistency(services.engine)
    # pocket by pocket through the store's own recomputation too
    async with services.engine.connect() as conn:
        for account in [*callers, *[o for o in owners if o], PLATFORM_ACCOUNT_ID]:
            balance, withdrawable = await pockets(services, account)
            assert await ledger_sum(conn, account, "balance") == balance
            assert await ledger_sum(conn, account, "withdrawable") == withdrawable
    for held in open_:
        await billing.refund(services, held)
    await check_ledger_consistency(services.engine)
    assert await rows(services, reservations, reservations.c.status == "open") == []
    # with nothing open, each caller's balance is its credits minus what its usage rows cost
    usage = await rows(services, usage_records)
    credits = await rows(services, ledger_entries, ledger_entries.c.kind == "admin_credit")
    for caller in callers:
        credited = sum(e["amount_micro_usd"] for e in credits if e["account_id"] == caller)
        spent = sum(u["cost_micro_usd"] for u in usage if u["account_id"] == caller)
        assert await pockets(services, caller) == (credited - spent, 0)


async def test_concurrent_crossing_settlements_neither_deadlock_nor_lose_money(make_services: MakeServices) -> None:
    """X's requests served by Y's machine while Y's are served by X's, all paying the platform, with
    reservations and refunds on the same capped keys in between: on Postgres, transactions that lock
    the same account rows in different orders deadlock (one is aborted); every step must go through."""
    services = await make_services(platform_fee_bps=500)
    x = await new_account(services, credit=1_000_000)
    y = await new_account(services, credit=1_000_000)
    key_x = await new_key(services, x, limit_micro_usd=900_000)
    key_y = await new_key(services, y, limit_micro_usd=900_000)
    usage = Usage(prompt_tokens=100, completion_tokens=50)
    held = []
    for n in range(30):
        held.append((await billing.reserve(services, f"x-{n}", x, key_x, 2_000), y))
        held.append((await billing.reserve(services, f"y-{n}", y, key_y, 2_000), x))

    async def settle(reservation: billing.Reservation, payee: str) -> None:
        await settle_paid(services, reservation, PRICED, usage, served(payee))

    async def reserve_and_refund(n: int) -> None:
        account, key = (x, key_x) if n % 2 else (y, key_y)
        reservation = await billing.reserve(services, f"extra-{n}", account, key, 1_000)
        await billing.refund(services, reservation)

    await asyncio.gather(*(settle(r, payee) for r, payee in held), *(reserve_and_refund(n) for n in range(30)))
    cost = expected_cost(PRICED, 100, 50)
    fee = cost * 500 // 10_000
    assert await pockets(services, x) == (1_000_000 - 30 * cost, 30 * (cost - fee))
    assert await pockets(services, y) == (1_000_000 - 30 * cost, 30 * (cost - fee))
    assert await pockets(services, PLATFORM_ACCOUNT_ID) == (0, 60 * fee)
    await check_ledger_consistency(services.engine)
