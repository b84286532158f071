"""billing.reserve: the balance debit, the reservation row and the ledger entry happen together or
not at all; refusals (funds, key caps) leave no trace; key caps count per window."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from darkbloom.coordinator.money import billing
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.services import Services
from darkbloom.wire.protocol import Usage
from darkbloom.store.schema import key_spend, ledger_entries, reservations

from tests.coordinator.money.conftest import PRICED, counts, ledger_for, new_account, new_key, pockets, rows
from tests.support.store_queries import key_window_spend
from tests.support.money import settle_paid

UTC = timezone.utc


def served(provider_account_id: str | None = None) -> billing.Served:
    return billing.Served(provider_id="prov_test", provider_account_id=provider_account_id)


async def test_reserve_debits_balance_writes_reservation_and_ledger_entry(services: Services) -> None:
    account = await new_account(services, credit=10_000)
    key = await new_key(services, account)
    reservation = await billing.reserve(services, "req-1", account, key, 3_000)

    assert reservation == billing.Reservation("req-1", account, key.id, 3_000, None)
    assert await pockets(services, account) == (7_000, 0)
    [row] = await rows(services, reservations, reservations.c.request_id == "req-1")
    assert (row["account_id"], row["key_id"], row["amount_micro_usd"], row["status"], row["instance_id"],
            row["window_start"], row["closed_at"]) == (account, key.id, 3_000, "open", services.instance_id,
                                                       None, None)
    [entry] = await ledger_for(services, "req-1")
    assert (entry["account_id"], entry["kind"], entry["pocket"], entry["amount_micro_usd"],
            entry["balance_after"]) == (account, "reservation", "balance", -3_000, 7_000)
    # a key without a cap keeps no spend window
    assert await rows(services, key_spend) == []


async def test_a_reused_request_id_is_refused_and_leaves_no_trace(services: Services) -> None:
    """A request id that already has a reservation cannot reserve again: no second debit, ledger
    entry or key hold (the same reservation again, a retried batch whose commit did land, is a no-op)."""
    account = await new_account(services, credit=10_000)
    key = await new_key(services, account, limit_micro_usd=50_000, limit_reset="none")
    await billing.reserve(services, "req-dup", account, key, 1_000)
    before = await counts(services.engine)
    with pytest.raises(billing.DuplicateReservation):
        await billing.reserve(services, "req-dup", account, key, 2_000)
    assert await billing.reserve(services, "req-dup", account, key, 1_000) == billing.Reservation(
        "req-dup", account, key.id, 1_000, 0)
    assert await pockets(services, account) == (9_000, 0)
    assert await counts(services.engine) == before
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (0, 1_000)


async def test_reserving_the_whole_balance_is_allowed(services: Services) -> None:
    account = await new_account(services, credit=5_000)
    await billing.reserve(services, "req-all", account, None, 5_000)
    assert await pockets(services, account) == (0, 0)


@pytest.mark.parametrize("capped", [False, True])
async def test_insufficient_funds_is_402_and_leaves_no_trace(services: Services, capped: bool) -> None:
    account = await new_account(services, credit=1_000)
    key = await new_key(services, account, **({"limit_micro_usd": 1_000_000} if capped else {}))
    before = await counts(services.engine)
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, "req-poor", account, key, 1_001)
    error = caught.value
    assert (error.status, error.type, error.code) == (402, "insufficient_funds", "insufficient_quota")
    assert await pockets(services, account) == (1_000, 0)
    assert await counts(services.engine) == before
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (0, 0)


async def test_key_cap_is_hard_and_counts_open_reservations(services: Services) -> None:
    account = await new_account(services, credit=100_000)
    key = await new_key(services, account, limit_micro_usd=5_000, limit_reset="none")
    await billing.reserve(services, "cap-1", account, key, 3_000)
    before = await counts(services.engine)
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, "cap-2", account, key, 2_001)
    assert (caught.value.status, caught.value.type, caught.value.code) == (402, "spend_cap_exceeded",
                                                                           "spend_cap_exceeded")
    assert await counts(services.engine) == before
    assert await pockets(services, account) == (97_000, 0)
    await billing.reserve(services, "cap-3", account, key, 2_000)  # exactly at the cap
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (0, 5_000)
    # another key of the same account has its own cap; the account's balance is shared
    other = await new_key(services, account, limit_micro_usd=5_000)
    await billing.reserve(services, "cap-other", account, other, 5_000)
    assert await pockets(services, account) == (90_000, 0)


async def test_settling_frees_the_unused_part_of_the_cap(services: Services) -> None:
    account = await new_account(services, credit=100_000)
    key = await new_key(services, account, limit_micro_usd=5_000)
    held = await billing.reserve(services, "cap-a", account, key, 5_000)
    with pytest.raises(ApiError):
        await billing.reserve(services, "cap-b", account, key, 100)
    settlement = await settle_paid(services, held, PRICED, Usage(prompt_tokens=10,
                                                                                       completion_tokens=10),
                                      served())
    assert settlement is not None
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (settlement.cost, 0)
    await billing.reserve(services, "cap-c", account, key, 5_000 - settlement.cost)
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, "cap-d", account, key, 1)
    assert caught.value.type == "spend_cap_exceeded"
    # a refund gives the whole hold back
    assert await billing.refund(services, billing.Reservation("cap-c", account, key.id, 5_000 - settlement.cost,
                                                              0))
    async with services.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, 0) == (settlement.cost, 0)


@pytest.mark.parametrize(("reset", "now", "start"), [
    ("daily", datetime(2024, 5, 15, 13, 45, 12, tzinfo=UTC), datetime(2024, 5, 15, tzinfo=UTC)),
    ("daily", datetime(2024, 5, 15, 0, 0, 0, tzinfo=UTC), datetime(2024, 5, 15, tzinfo=UTC)),
    ("daily", datetime(2024, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), datetime(2024, 12, 31, tzinfo=UTC)),
    ("weekly", datetime(2024, 5, 15, 13, 45, tzinfo=UTC), datetime(2024, 5, 13, tzinfo=UTC)),   # Wed → Mon
    ("weekly", datetime(2024, 5, 19, 23, 59, tzinfo=UTC), datetime(2024, 5, 13, tzinfo=UTC)),   # Sun → Mon
    ("weekly", datetime(2024, 5, 20, 0, 0, tzinfo=UTC), datetime(2024, 5, 20, tzinfo=UTC)),     # Mon itself
    ("weekly", datetime(2025, 1, 2, 8, 0, tzinfo=UTC), datetime(2024, 12, 30, tzinfo=UTC)),     # across a year
    ("monthly", datetime(2024, 5, 31, 23, 59, tzinfo=UTC), datetime(2024, 5, 1, tzinfo=UTC)),
    ("monthly", datetime(2024, 2, 29, 12, 0, tzinfo=UTC), datetime(2024, 2, 1, tzinfo=UTC)),
    ("monthly", datetime(2024, 6, 1, 0, 0, tzinfo=UTC), datetime(2024, 6, 1, tzinfo=UTC)),
])
def test_spend_window_start(reset: str, now: datetime, start: datetime) -> None:
    assert billing.spend_window_start(reset, now) == int(start.timestamp())


@pytest.mark.parametrize("now", [datetime(2001, 1, 1, tzinfo=UTC), datetime(2031, 7, 9, 3, 0, tzinfo=UTC)])
def test_spend_window_none_is_one_window_forever(now: datetime) -> None:
    assert billing.spend_window_start("none", now) == 0


def _clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, datetime]:
    """Make ``reserve`` see ``state['now']`` as the current time when it picks the key's window."""
    state: dict[str, Any] = {}
    real = billing.spend_window_start
    monkeypatch.setattr(billing, "spend_window_start", lambda reset, now=None: real(reset, now or state["now"]))
    return state


@pytest.mark.parametrize(("reset", "same_window", "next_window"), [
    ("daily", [datetime(2024, 5, 15, 0, 0, tzinfo=UTC), datetime(2024, 5, 15, 23, 59, 59, tzinfo=UTC)],
     datetime(2024, 5, 16, 0, 0, 1, tzinfo=UTC)),
    ("weekly", [datetime(2024, 5, 13, 1, 0, tzinfo=UTC), datetime(2024, 5, 19, 23, 0, tzinfo=UTC)],
     datetime(2024, 5, 20, 0, 30, tzinfo=UTC)),
    ("monthly", [datetime(2024, 1, 1, 0, 0, tzinfo=UTC), datetime(2024, 1, 31, 23, 59, tzinfo=UTC)],
     datetime(2024, 2, 1, 0, 0, tzinfo=UTC)),
])
async def test_cap_resets_with_its_window(services: Services, monkeypatch: pytest.MonkeyPatch, reset: str,
                                          same_window: list[datetime], next_window: datetime) -> None:
    clock = _clock(monkeypatch)
    account = await new_account(services, credit=1_000_000)
    key = await new_key(services, account, limit_micro_usd=4_000, limit_reset=reset)
    clock["now"] = same_window[0]
    first = await billing.reserve(services, f"{reset}-1", account, key, 4_000)
    assert first.window_start == billing.spend_window_start(reset, same_window[0])
    await settle_paid(services, first, PRICED, Usage(prompt_tokens=3_000, completion_tokens=0),
                         served())
    clock["now"] = same_window[1]
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, f"{reset}-2", account, key, 1)
    assert caught.value.type == "spend_cap_exceeded"
    clock["now"] = next_window
    second = await billing.reserve(services, f"{reset}-3", account, key, 4_000)
    assert second.window_start == billing.spend_window_start(reset, next_window) != first.window_start
    windows = {r["window_start"]: (r["spent_micro_usd"], r["reserved_micro_usd"])
               for r in await rows(services, key_spend, key_spend.c.key_id == key.id)}
    assert windows == {first.window_start: (4_000, 0), second.window_start: (0, 4_000)}
    # settling the new window's reservation later still books it to its own window
    clock["now"] = datetime(2030, 1, 1, tzinfo=UTC)
    assert await billing.refund(services, second)
    windows = {r["window_start"]: (r["spent_micro_usd"], r["reserved_micro_usd"])
               for r in await rows(services, key_spend, key_spend.c.key_id == key.id)}
    assert windows == {first.window_start: (4_000, 0), second.window_start: (0, 0)}


async def test_cap_without_reset_never_resets(services: Services, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _clock(monkeypatch)
    account = await new_account(services, credit=1_000_000)
    key = await new_key(services, account, limit_micro_usd=4_000, limit_reset="none")
    clock["now"] = datetime(2024, 1, 1, tzinfo=UTC)
    held = await billing.reserve(services, "none-1", account, key, 4_000)
    await settle_paid(services, held, PRICED, Usage(prompt_tokens=3_000, completion_tokens=0),
                         served())
    for later in (datetime(2024, 1, 2, tzinfo=UTC), datetime(2024, 2, 1, tzinfo=UTC), datetime(2029, 1, 1, tzinfo=UTC)):
        clock["now"] = later
        with pytest.raises(ApiError) as caught:
            await billing.reserve(services, f"none-{later.year}-{later.month}-{later.day}", account, key, 1)
        assert caught.value.type == "spend_cap_exceeded"
    assert [(r["window_start"], r["spent_micro_usd"]) for r in await rows(services, key_spend)] == [(0, 4_000)]


async def test_zero_cap_refuses_every_paid_request(services: Services) -> None:
    account = await new_account(services, credit=1_000_000)
    key = await new_key(services, account, limit_micro_usd=0)
    with pytest.raises(ApiError) as caught:
        await billing.reserve(services, "zero", account, key, 100)
    assert caught.value.type == "spend_cap_exceeded"
    assert await rows(services, ledger_entries, ledger_entries.c.request_id == "zero") == []
