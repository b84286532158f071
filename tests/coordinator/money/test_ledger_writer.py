"""The ledger writer (group commit), on SQLite and Postgres: steps queued together commit in one
transaction, in arrival order; a refused step is a result for its caller only; a failed batch is
retried without losing or repeating a step, and one bad step cannot sink the others; a caller that
goes away mid-reservation gets the hold back; two writers on one database cross without deadlock."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from typing import Any, Callable

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from darkbloom.coordinator.money import billing
from darkbloom.coordinator.money.ledger import rules
from darkbloom.coordinator.money.ledger import sqlite as sqlite_ledger
from darkbloom.coordinator.money.ledger.writer import LedgerUnavailable, LedgerWriter, backend_for
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts as account_store
from darkbloom.store import ledger as ledger_store
from darkbloom.store.schema import PLATFORM_ACCOUNT_ID, reservations, usage_records
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.protocol import Usage

from tests.coordinator.money.conftest import (PRICED, MakeServices, counts, new_account,
                                              new_key, pockets, rows)
from tests.support.metrics import sample
from tests.support.money import check_ledger_consistency, settle_paid

USAGE = Usage(prompt_tokens=100, completion_tokens=50)


def served(owner: str | None) -> billing.Served:
    return billing.Served(provider_id="prov_w", provider_account_id=owner)


def under_load(services: Services) -> None:
    """As when the process serves other requests: every step queues for the writer's batches (a quiet
    process applies one at once when it can: the tests below the writer's own)."""
    services.requests_in_flight = 2


async def together(*work: Any) -> list[Any]:
    """Start every call before any runs: they reach the writer in this order, as one batch."""
    tasks = [asyncio.ensure_future(w) for w in work]
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def test_one_batch_refusals_are_results_for_their_callers_only(services: Services) -> None:
    under_load(services)
    account = await new_account(services, credit=5_000)
    key = await new_key(services, account, limit_micro_usd=3_000)
    batches = services.ledger.batches
    first, capped, second, poor = await together(
        billing.reserve(services, "b-1", account, key, 2_000),
        billing.reserve(services, "b-2", account, key, 2_000),    # 2,000 + 2,000 > the 3,000 cap
        billing.reserve(services, "b-3", account, None, 3_000),   # no cap; takes the rest of the balance
        billing.reserve(services, "b-4", account, None, 1))
    assert services.ledger.batches == batches + 1
    assert isinstance(first, billing.Reservation) and isinstance(second, billing.Reservation)
    assert isinstance(capped, ApiError) and (capped.status, capped.type) == (402, "spend_cap_exceeded")
    assert isinstance(poor, ApiError) and (poor.status, poor.type, poor.code) == (
        402, "insufficient_funds", "insufficient_quota")
    assert "up to 1 µUSD" in poor.message
    assert await pockets(services, account) == (0, 0)
    assert {r["request_id"] for r in await rows(services, reservations)} == {"b-1", "b-3"}
    await check_ledger_consistency(services.engine)


async def test_steps_apply_in_arrival_order(services: Services) -> None:
    account = await new_account(services, credit=1_000)
    held = billing.Reservation("o-1", account, None, 1_000, None)
    results = await together(
        billing.reserve(services, "o-1", account, None, 1_000),
        billing.refund(services, held),                            # gives it back before o-2 asks
        billing.reserve(services, "o-2", account, None, 1_000),
        billing.reserve(services, "o-3", account, None, 1))        # after o-2 took everything
    assert results[1] is True and isinstance(results[2], billing.Reservation)
    assert isinstance(results[3], ApiError) and results[3].type == "insufficient_funds"
    status = {r["request_id"]: r["status"] for r in await rows(services, reservations)}
    assert status == {"o-1": "refunded", "o-2": "open"}
    await check_ledger_consistency(services.engine)


async def test_a_repeated_settlement_in_the_same_batch_is_a_no_op(services: Services) -> None:
    caller = await new_account(services, credit=10_000)
    owner = await new_account(services)
    held = await billing.reserve(services, "twice", caller, None, 5_000)
    first, second, late = await together(settle_paid(services, held, PRICED, USAGE, served(owner)),
                                         settle_paid(services, held, PRICED, USAGE, served(owner)),
                                         billing.refund(services, held))
    assert isinstance(first, billing.Settlement) and second is None and late is False
    assert await pockets(services, caller) == (10_000 - first.cost, 0)
    assert len(await rows(services, usage_records)) == 1
    await check_ledger_consistency(services.engine)


async def test_a_crowd_commits_as_one_batch(services: Services) -> None:
    under_load(services)
    account = await new_account(services, credit=1_000_000)
    batches = services.ledger.batches
    held = await together(*(billing.reserve(services, f"crowd-{n}", account, None, 1_000) for n in range(300)))
    assert services.ledger.batches == batches + 1
    assert await together(*(billing.refund(services, r) for r in held)) == [True] * 300
    assert services.ledger.batches == batches + 2
    assert await pockets(services, account) == (1_000_000, 0)


class Flaky:
    """A real backend that fails its next ``failures`` batches: before writing anything, or (with
    ``after_commit``) after committing them — a connection lost while COMMIT's answer was on its way."""

    def __init__(self, real: Any, failures: int, after_commit: bool = False) -> None:
        self.real, self.failures, self.after_commit = real, failures, after_commit

    async def apply(self, steps: list[rules.Step]) -> list[Any]:
        if self.failures:
            self.failures -= 1
            if self.after_commit:
                await self.real.apply(steps)
            raise OperationalError("batch", {}, Exception("connection lost"))
        return list(await self.real.apply(steps))

    def apply_now(self, steps: list[rules.Step]) -> None:
        return None  # every batch through ``apply``, where it fails

    async def close(self) -> None:
        await self.real.close()


@pytest.mark.parametrize("after_commit", [False, True])
async def test_a_failed_batch_is_retried_without_losing_or_repeating_a_step(
        services: Services, after_commit: bool, caplog: pytest.LogCaptureFixture) -> None:
    caller = await new_account(services, credit=10_000)
    owner = await new_account(services)
    key = await new_key(services, caller, limit_micro_usd=9_000)
    held = await billing.reserve(services, "retry-1", caller, key, 4_000)
    await services.ledger.close()
    services.ledger = LedgerWriter(backend=Flaky(backend_for(services.engine), failures=2,
                                                 after_commit=after_commit))
    with caplog.at_level(logging.WARNING, logger="darkbloom.ledger"):
        settled, reserved = await together(settle_paid(services, held, PRICED, USAGE, served(owner)),
                                           billing.reserve(services, "retry-2", caller, key, 3_000))
    assert "failed (attempt 1 of 4)" in caplog.text
    # the retried settlement finds its own first commit and is a no-op; the reservation is itself again
    assert (settled is None) == after_commit and isinstance(reserved, billing.Reservation)
    [usage] = await rows(services, usage_records)
    assert await pockets(services, caller) == (10_000 - usage["cost_micro_usd"] - 3_000, 0)
    assert len(await rows(services, reservations)) == 2
    await check_ledger_consistency(services.engine)


async def test_one_bad_step_does_not_sink_its_batch(services: Services) -> None:
    account = await new_account(services, credit=10_000)
    bad = rules.Settle("ghost", "acct_missing", None, PRICED.id, "prov_w", None, 1, 1, 0, 500,
                       reserved=False, self_routed=True, routed="owned")  # its usage row breaks a FK
    before = services.ledger.batches
    first, failed, second = await together(billing.reserve(services, "ok-1", account, None, 1_000),
                                           services.ledger.run(bad),
                                           billing.reserve(services, "ok-2", account, None, 2_000))
    assert isinstance(first, billing.Reservation) and isinstance(second, billing.Reservation)
    assert isinstance(failed, LedgerUnavailable)
    assert services.ledger.batches == before + 2  # the two good steps, each alone after the batch failed
    assert await pockets(services, account) == (7_000, 0)
    await check_ledger_consistency(services.engine)


async def test_a_caller_gone_mid_reservation_gets_the_hold_back(services: Services) -> None:
    under_load(services)
    account = await new_account(services, credit=10_000)
    task = asyncio.ensure_future(billing.reserve(services, "gone", account, None, 4_000))
    await asyncio.sleep(0)  # submitted, not yet committed
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if [r["status"] for r in await rows(services, reservations)] == ["refunded"]:
            break
        await asyncio.sleep(0.02)
    assert [r["status"] for r in await rows(services, reservations)] == ["refunded"]
    assert await pockets(services, account) == (10_000, 0)


async def test_a_closed_writer_refuses_new_steps(services: Services) -> None:
    under_load(services)
    account = await new_account(services, credit=10_000)
    queued = asyncio.ensure_future(billing.reserve(services, "last", account, None, 1_000))
    await asyncio.sleep(0)
    await services.ledger.close()  # commits what is queued first
    assert isinstance(await queued, billing.Reservation)
    with pytest.raises(LedgerUnavailable):
        services.ledger.submit(rules.Refund("last"))


async def test_exclusive_usage_rows_go_through_the_writer(services: Services,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    owner = await new_account(services)
    payer = await new_account(services, credit=150)
    before = await counts(services.engine)

    def bill(request_id: str, account: str) -> billing.Bill:
        return billing.Bill(request_id, account, None, PRICED, None, self_routed=True)

    with caplog.at_level(logging.WARNING, logger="darkbloom.billing"):
        free, paid, short = await together(
            billing.settle_bill(services, bill("mine", owner), USAGE, served(owner)),
            billing.settle_bill(services, bill("theirs", payer), Usage(prompt_tokens=1, completion_tokens=1),
                                served(owner)),  # the minimum charge: 100 of its 150
            billing.settle_bill(services, bill("short", payer), USAGE, served(owner)))  # 368 > the 50 left
    assert free == billing.Settlement(0, 0, 0)
    assert paid == billing.Settlement(100, 5, 95)
    assert short == billing.Settlement(0, 0, 0) and "cannot be collected" in caplog.text
    usage = {u["request_id"]: u for u in await rows(services, usage_records)}
    assert {k: (u["cost_micro_usd"], u["self_routed"]) for k, u in usage.items()} == {
        "mine": (0, True), "theirs": (100, False), "short": (0, False)}
    assert (await counts(services.engine))["reservations"] == before["reservations"]
    assert await pockets(services, payer) == (50, 0)
    assert await pockets(services, owner) == (0, 95)
    assert await billing.settle_bill(services, bill("mine", owner), USAGE, served(owner)) is None
    await check_ledger_consistency(services.engine)


async def test_on_sqlite_only_a_batch_that_charges_waits_for_the_disk(services: Services) -> None:
    """docs/billing.md "The ledger writer": a batch commits at ``synchronous=FULL`` (synced before its
    callers hear) when it settles a charge, at ``NORMAL`` otherwise — reservations, refunds, and free
    settlements, whose loss to a system crash the reconciler makes good."""
    if services.engine.dialect.name != "sqlite":
        pytest.skip("the SQLite ledger's own connection")
    under_load(services)
    account = await new_account(services, credit=100_000)
    owner = await new_account(services)
    statements: list[str] = []
    backend = services.ledger._backend_now()
    backend._connect().set_trace_callback(statements.append)  # type: ignore[attr-defined]

    first, second = await together(billing.reserve(services, "s-1", account, None, 1_000),
                                   billing.reserve(services, "s-2", account, None, 1_000))
    await settle_paid(services, first, PRICED, USAGE, served(None))  # a charge: FULL
    third, _ = await together(billing.reserve(services, "s-3", account, None, 1_000),
                              billing.refund(services, second))  # nothing charged: NORMAL
    free = billing.Bill("s-free", owner, None, PRICED, None, self_routed=True)
    assert await billing.settle_bill(services, free, USAGE, served(owner)) == billing.Settlement(0, 0, 0)
    assert backend._connect().execute("PRAGMA synchronous").fetchone() == (1,)  # type: ignore[attr-defined]  # NORMAL
    await together(settle_paid(services, third, PRICED, USAGE, served(None)),
                   billing.reserve(services, "s-4", account, None, 1_000))  # one batch: it waits

    levels = [s.removeprefix("PRAGMA synchronous=") if s.startswith("PRAGMA") else s
              for s in statements if s.startswith(("PRAGMA synchronous=", "COMMIT"))]
    assert levels == ["NORMAL", "COMMIT", "FULL", "COMMIT", "NORMAL", "COMMIT", "COMMIT", "FULL", "COMMIT"]
    await check_ledger_consistency(services.engine)


def traced_threads(services: Services, also: Callable[[str, str], object] = lambda thread, sql: None
                   ) -> list[tuple[str, str]]:
    """(thread name, statement) for every statement the SQLite ledger's connection runs from now (each
    also given to ``also`` as it starts)."""
    statements: list[tuple[str, str]] = []

    def trace(sql: str) -> None:
        statements.append((threading.current_thread().name, sql))
        also(*statements[-1])

    services.ledger._backend_now()._connect().set_trace_callback(trace)  # type: ignore[attr-defined]
    return statements


def committed_on(statements: list[tuple[str, str]]) -> list[str]:
    return ["loop" if thread == "MainThread" else "writer" for thread, sql in statements if sql == "COMMIT"]


async def test_a_quiet_process_applies_what_need_not_wait_at_once(services: Services) -> None:
    """One request in flight: a reservation, a refund and a free usage row commit on the loop's thread
    as they are submitted (no hop to the writer's thread and back); a charge still goes to the writer's
    thread, where it waits for the disk; under load everything queues for the writer."""
    if services.engine.dialect.name != "sqlite":
        pytest.skip("the SQLite ledger applies at once; Postgres is a round trip either way")
    account, owner = await new_account(services, credit=100_000), await new_account(services)
    statements = traced_threads(services)
    services.requests_in_flight = 1

    future = services.ledger.submit(rules.Reserve("q-1", account, None, 1_000, None, None, "inst"))
    assert future.done() and future.result() == rules.RESERVED  # before any turn of the loop
    assert await billing.refund(services, billing.Reservation("q-1", account, None, 1_000, None)) is True
    free = billing.Bill("q-free", owner, None, PRICED, None, self_routed=True)
    assert await billing.settle_bill(services, free, USAGE, served(owner)) == billing.Settlement(0, 0, 0)
    assert committed_on(statements) == ["loop", "loop", "loop"]
    assert services.ledger._task is None  # the writer's task never had to run

    held = await billing.reserve(services, "q-2", account, None, 1_000)
    settled = await settle_paid(services, held, PRICED, USAGE, served(None))  # a charge: synced, on the thread
    assert settled is not None and settled.cost > 0
    assert committed_on(statements)[3:] == ["loop", "writer"]
    under_load(services)
    await billing.reserve(services, "q-3", account, None, 1_000)
    assert committed_on(statements)[5:] == ["writer"]
    assert await pockets(services, account) == (100_000 - settled.cost - 1_000, 0)
    await check_ledger_consistency(services.engine)


async def test_a_locked_database_is_not_waited_for_on_the_loop(services: Services) -> None:
    """Another connection holds SQLite's write lock: the loop's attempt gives up at once and the step
    goes to the writer's thread, which waits for the lock. (Had the loop waited, it would have taken
    the lock once released — a second after its attempt — and committed there.)"""
    if services.engine.dialect.name != "sqlite":
        pytest.skip("SQLite's write lock")
    account = await new_account(services, credit=10_000)
    attempted, locked = threading.Event(), threading.Event()
    statements = traced_threads(services, lambda thread, sql: sql == "BEGIN IMMEDIATE" and thread == "MainThread"
                                and attempted.set())

    def hold_the_lock() -> None:
        other = sqlite3.connect(services.engine.url.database or "", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        locked.set()
        attempted.wait(30)
        time.sleep(1.0)  # well after the loop's attempt
        other.execute("COMMIT")
        other.close()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    locked.wait(30)
    services.requests_in_flight = 1
    try:
        future = services.ledger.submit(rules.Reserve("lk-1", account, None, 1_000, None, None, "inst"))
        assert attempted.is_set() and not future.done()
        assert await future == rules.RESERVED
    finally:
        await asyncio.to_thread(holder.join)
    assert committed_on(statements) == ["writer"]


async def test_the_log_is_checkpointed_on_the_writer_thread(services: Services,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit on the loop's thread never checkpoints the log (SQLite would, in the commit that fills
    it, and sync): after ``CHECKPOINT_EVERY`` of them the next batch goes to the writer's thread, which
    checkpoints after it; the writer's own commits checkpoint as SQLite does."""
    if services.engine.dialect.name != "sqlite":
        pytest.skip("SQLite's write-ahead log")
    monkeypatch.setattr(sqlite_ledger, "CHECKPOINT_EVERY", 2)
    account = await new_account(services, credit=10_000)
    statements = traced_threads(services)
    services.requests_in_flight = 1
    for n in range(5):
        await billing.reserve(services, f"ck-{n}", account, None, 100)
    assert committed_on(statements) == ["loop", "loop", "writer", "loop", "loop"]
    checkpoints = [thread for thread, sql in statements if sql.startswith("PRAGMA wal_checkpoint")]
    assert checkpoints == ["ledger-writer_0"]
    setting, in_effect = "1000", []  # the automatic checkpoint's setting at each commit
    for thread, sql in statements:
        if sql.startswith("PRAGMA wal_autocheckpoint="):
            setting = sql.removeprefix("PRAGMA wal_autocheckpoint=")
        elif sql == "COMMIT":
            in_effect.append(setting)
    assert in_effect == ["0", "0", "1000", "0", "0"]


async def test_two_writers_on_one_database_cross_without_deadlock(make_services: MakeServices) -> None:
    """Two coordinator processes' writers (own engines, own instance ids): X pays Y on one while Y
    pays X on the other, both paying the platform, with reservations in between."""
    one, two = await make_services(), await make_services()
    x = await new_account(one, credit=1_000_000)
    y = await new_account(one, credit=1_000_000)
    held = [(await billing.reserve(one, f"x-{n}", x, None, 2_000), y, one) for n in range(40)]
    held += [(await billing.reserve(two, f"y-{n}", y, None, 2_000), x, two) for n in range(40)]

    async def churn(services: Services, account: str, n: int) -> None:
        reservation = await billing.reserve(services, f"c-{account}-{n}", account, None, 1_000)
        await billing.refund(services, reservation)

    results = await together(*(settle_paid(s, r, PRICED, USAGE, served(payee)) for r, payee, s in held),
                             *(churn(one if n % 2 else two, x if n % 3 else y, n) for n in range(40)))
    assert not [r for r in results if isinstance(r, BaseException)]
    cost = results[0].cost
    fee = cost * 500 // 10_000
    assert await pockets(one, x) == (1_000_000 - 40 * cost, 40 * (cost - fee))
    assert await pockets(two, y) == (1_000_000 - 40 * cost, 40 * (cost - fee))
    assert await pockets(one, PLATFORM_ACCOUNT_ID) == (0, 80 * fee)
    await check_ledger_consistency(one.engine)


async def test_three_writers_racing_for_one_balance_never_take_more_than_it_holds(
        make_services: MakeServices) -> None:
    """Three coordinators' writers reserve from one balance at once, each having seen it whole (on
    Postgres each plans on the balance it knows, stale by the others' reservations): together they
    take exactly what it holds, and every other reservation is refused."""
    writers = [await make_services() for _ in range(3)]
    payer = await new_account(writers[0], credit=40_000)
    for n, services in enumerate(writers):  # each writer reads (and knows) the whole balance
        await billing.refund(services, await billing.reserve(services, f"seen-{n}", payer, None, 1_000))
    results = await together(*(billing.reserve(writers[n % 3], f"race-{n}", payer, None, 1_000) for n in range(60)))
    taken = [r for r in results if isinstance(r, billing.Reservation)]
    refused = [r for r in results if isinstance(r, ApiError)]
    assert len(taken) == 40 and len(refused) == 20, results
    assert {r.type for r in refused} == {"insufficient_funds"}
    assert await pockets(writers[0], payer) == (0, 0)
    await check_ledger_consistency(writers[0].engine)


async def test_on_postgres_a_batch_holds_rows_only_from_its_write(services: Services) -> None:
    """docs/billing.md "The ledger writer": on Postgres a batch reads without a lock, and its write locks
    the rows it changes, checks them and moves accounts by addition. Another transaction holding the
    payer's and the platform's rows stops no read: the batch waits at its write, and its moves land on
    top of what that transaction committed, each entry's ``balance_after`` the running sum. A payer
    whose balance fell meanwhile below what the batch takes makes the write write nothing, and the batch
    is refused on a fresh read."""
    if services.engine.dialect.name != "postgresql":
        pytest.skip("row locks of the Postgres ledger")
    payer = await new_account(services, credit=100_000)
    other = await new_account(services, credit=1_000)
    first = await billing.reserve(services, "pl-1", payer, None, 5_000)
    async with services.engine.connect() as conn:  # one open transaction: its rows stay locked until it ends
        await ledger_store.move(conn, other, "balance", -18, "test_move")
        await ledger_store.move(conn, payer, "balance", 11, "test_move")
        await ledger_store.move(conn, PLATFORM_ACCOUNT_ID, "withdrawable", 7, "test_move")
        settling = asyncio.ensure_future(settle_paid(services, first, PRICED, USAGE, served(None)))
        reserving = asyncio.ensure_future(billing.reserve(services, "pl-2", payer, None, 1_000))
        waiting = await _lock_waiters(services)
        assert waiting and all(query.lstrip().startswith("WITH") for query in waiting), waiting  # the write
        assert not settling.done() and not reserving.done()
        await conn.commit()
    settled, second = await asyncio.wait_for(asyncio.gather(settling, reserving), 10)
    assert settled is not None and settled.cost > 0 and second.amount == 1_000
    assert await pockets(services, PLATFORM_ACCOUNT_ID) == (0, 7 + settled.cost)  # no owner: fee and payout
    assert await pockets(services, payer) == (100_000 + 11 - settled.cost - 1_000, 0)
    await check_ledger_consistency(services.engine)

    balance = (await pockets(services, payer))[0]
    async with services.engine.connect() as conn:
        await ledger_store.move(conn, payer, "balance", -(balance - 500), "test_move")  # 500 left, uncommitted
        await ledger_store.move(conn, other, "balance", balance - 500, "test_move")
        reserving = asyncio.ensure_future(billing.reserve(services, "pl-3", payer, None, 1_000))
        assert await _lock_waiters(services)
        await conn.commit()
    with pytest.raises(ApiError) as refused:
        await asyncio.wait_for(reserving, 10)
    assert refused.value.type == "insufficient_funds"
    assert await pockets(services, payer) == (500, 0)
    await billing.refund(services, second)
    await check_ledger_consistency(services.engine)


async def test_on_postgres_a_batch_on_known_rows_is_its_write_alone(services: Services,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose rows this coordinator has read or written before is planned on them and written
    without a read; a refusal is never decided on them: a caller another coordinator credited since
    is read again, and served."""
    if services.engine.dialect.name != "postgresql":
        pytest.skip("the Postgres ledger's known rows")
    from darkbloom.coordinator.money.ledger import postgres

    payer = await new_account(services, credit=10_000)
    owner = await new_account(services)
    first = await billing.reserve(services, "kn-1", payer, None, 4_000)  # read: payer, platform
    await settle_paid(services, first, PRICED, USAGE, served(owner))     # read: the owner
    reads: list[list[rules.Step]] = []
    real_read = postgres._read_rows

    async def counted(raw: Any, steps: list[rules.Step], statement: str) -> rules.State:
        reads.append(steps)
        return await real_read(raw, steps, statement)

    monkeypatch.setattr(postgres, "_read_rows", counted)
    known = sample("darkbloom_ledger_batches_total", plan="known")  # on /metrics
    second = await billing.reserve(services, "kn-2", payer, None, 4_000)
    settled = await settle_paid(services, second, PRICED, USAGE, served(owner))
    assert settled is not None and settled.cost > 0
    assert reads == [] and sample("darkbloom_ledger_batches_total", plan="known") == known + 2

    balance = (await pockets(services, payer))[0]
    async with services.engine.begin() as conn:  # a credit the writer did not make: its known balance is low
        await account_store.credit(conn, payer, 9_000, "ref-known")
    third = await billing.reserve(services, "kn-3", payer, None, balance + 1_000)
    assert third.amount == balance + 1_000 and len(reads) == 1
    await billing.refund(services, third)
    await check_ledger_consistency(services.engine)


async def test_on_postgres_a_usage_row_for_an_unmoved_caller_closes_no_cycle(services: Services) -> None:
    """A free request's usage row holds its caller's account ``FOR KEY SHARE`` (the foreign key) after
    the batch's own locks, on an account the batch does not move. Batch A (X's free request, Z's paid
    one) holds the platform's row when it inserts that row; batch B (X's paid request) holds X and
    waits for the platform's. A's key-share lock must not wait for B: no deadlock, both land."""
    if services.engine.dialect.name != "postgresql":
        pytest.skip("row locks of the Postgres ledger")
    from darkbloom.coordinator.money.ledger.postgres import PostgresLedger

    x = await new_account(services, credit=10_000)
    z = await new_account(services, credit=10_000)

    def settle(request_id: str, account: str, cost: int) -> rules.Settle:
        return rules.Settle(request_id, account, None, "m", "prov_w", None, 1, 1, cost, 1_000, reserved=False,
                            self_routed=cost == 0, routed="owned" if cost == 0 else "fleet")

    one, two = PostgresLedger(services.engine), PostgresLedger(services.engine)
    try:
        async with services.engine.connect() as conn:  # the platform's row held until both batches wait
            await ledger_store.move(conn, PLATFORM_ACCOUNT_ID, "withdrawable", 0, "test_move")
            first = asyncio.ensure_future(one.apply([settle("cy-a1", x, 0), settle("cy-a2", z, 100)]))
            assert await _lock_waiters(services)
            second = asyncio.ensure_future(two.apply([settle("cy-b1", x, 100)]))
            await _lock_waiters(services, count=2)
            await conn.commit()
        done = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 10)
    finally:
        await one.close()
        await two.close()
    assert not [r for r in done if isinstance(r, BaseException)], done
    assert await pockets(services, x) == (10_000 - 100, 0) and await pockets(services, z) == (10_000 - 100, 0)
    await check_ledger_consistency(services.engine)


async def test_a_pocket_below_zero_still_takes_what_it_is_given(services: Services) -> None:
    """A pocket the ledger only adds to is not checked: an account left below zero (by hand, or by data
    from before this ledger) still gets its refund."""
    payer = await new_account(services, credit=5_000)
    held = await billing.reserve(services, "neg-1", payer, None, 1_000)
    async with services.engine.begin() as conn:
        await conn.execute(text("UPDATE accounts SET balance_micro_usd = -5 WHERE id = :id"), {"id": payer})
    assert await billing.refund(services, held) is True
    assert await pockets(services, payer) == (995, 0)


async def test_on_postgres_the_ledger_finds_every_row_by_its_key(services: Services) -> None:
    """The Postgres ledger's two statements run as plans made once per connection: each must find the
    rows it reads, locks and changes through an index condition, never by a pass over a table (the read
    once picked a batch's accounts with an OR that no index could serve: 7 ms at 50,000 accounts)."""
    if services.engine.dialect.name != "postgresql":
        pytest.skip("the Postgres ledger's plans")
    from darkbloom.coordinator.money.ledger import postgres

    tables = {"accounts", "reservations", "key_spend", "usage_records", "ledger_entries"}
    statements = {"snapshot": (postgres._SNAPSHOT, "'{r}', '{k}', '{1}', '{a}', '{u}', 'f', 'p'"),
                  "locked": (postgres._LOCKED, "'{r}', '{k}', '{1}', '{a}', '{u}', 'f', 'p'"),
                  "write": (postgres._WRITE, ", ".join(["'[]'"] * 7 + ["'{r}'", "'[]'", "'p'", "0"]))}
    async with services.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        await raw.execute(postgres._SESSION)
        try:
            for name, (statement, literals) in statements.items():
                await raw.execute(f"PREPARE ledger_{name} AS {statement}")
                plan = await raw.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE ledger_{name}({literals})")
                plan = json.loads(plan) if isinstance(plan, str) else plan  # the engine's codec may decode it
                scans = [node for node in _plan_nodes(plan[0]["Plan"]) if node.get("Relation Name") in tables
                         and node["Node Type"] != "ModifyTable"]
                assert scans, name
                for node in scans:
                    assert node["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan"), (name, node)
                    assert node.get("Index Cond") or node.get("Recheck Cond"), (name, node)
        finally:
            await raw.execute("DEALLOCATE ALL; RESET ALL")
            await conn.invalidate()


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


async def _lock_waiters(services: Services, seconds: float = 10.0, count: int = 1) -> list[str]:
    """The queries of this database's backends waiting for a lock, polled until there are ``count``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        async with services.engine.connect() as conn:
            queries = list((await conn.execute(text(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"))).scalars())
        if len(queries) >= count or loop.time() > deadline:
            return queries
        await asyncio.sleep(0.02)


async def test_a_dropped_postgres_connection_is_replaced(services: Services) -> None:
    """The server ends the writer's connection between batches: the next batch gets a fresh one
    (noticed before it is used, or by a failed attempt that is retried)."""
    if services.engine.dialect.name != "postgresql":
        pytest.skip("a Postgres server dropping the writer's connection")
    account = await new_account(services, credit=10_000)
    await billing.reserve(services, "before-drop", account, None, 1_000)  # the writer holds its connection now
    async with services.engine.connect() as conn:
        await conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    held = await billing.reserve(services, "after-drop", account, None, 2_000)
    assert held.amount == 2_000
    assert await pockets(services, account) == (7_000, 0)
    await check_ledger_consistency(services.engine)
