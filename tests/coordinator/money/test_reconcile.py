"""instances.reconcile_abandoned: reservations of a coordinator instance that stopped heartbeating
are refunded (once, and logged); those of live instances, this one included, are kept."""

from __future__ import annotations

import logging
import time

import pytest
from sqlalchemy import update

from darkbloom.coordinator.money import billing
from darkbloom.coordinator.money import reconciliation as instances
from darkbloom.wire.protocol import Usage
from darkbloom.store.schema import coordinator_instances, reservations

from tests.coordinator.money.conftest import PRICED, MakeServices, new_account, new_key, pockets, rows
from tests.support.store_queries import key_window_spend
from tests.support.money import check_ledger_consistency, settle_paid


async def _age(services: object, instance_id: str, seconds: float) -> None:
    async with services.engine.begin() as conn:  # type: ignore[attr-defined]
        await conn.execute(update(coordinator_instances).where(coordinator_instances.c.id == instance_id)
                           .values(last_seen=int(time.time() - seconds)))


async def test_stale_instances_reservations_are_refunded_live_ones_kept(
        make_services: MakeServices, caplog: pytest.LogCaptureFixture) -> None:
    crashed = await make_services(instance_stale_after=30)
    alive = await make_services(instance_stale_after=30)
    me = await make_services(instance_stale_after=30)
    for services in (crashed, alive, me):
        await instances.register_instance(services)
    await _age(crashed, crashed.instance_id, 31)
    await _age(alive, alive.instance_id, 10)

    account = await new_account(me, credit=100_000)
    key = await new_key(me, account, limit_micro_usd=50_000, limit_reset="monthly")
    lost_1 = await billing.reserve(crashed, "lost-1", account, key, 4_000)
    lost_2 = await billing.reserve(crashed, "lost-2", account, None, 6_000)
    kept_alive = await billing.reserve(alive, "kept-alive", account, key, 7_000)
    kept_mine = await billing.reserve(me, "kept-mine", account, None, 8_000)
    closed = await billing.reserve(crashed, "closed", account, None, 1_000)
    assert await billing.refund(crashed, closed)
    assert await pockets(me, account) == (100_000 - 25_000, 0)

    with caplog.at_level(logging.INFO, logger="darkbloom.instances"):
        assert await instances.reconcile_abandoned(me) == 2
    assert await pockets(me, account) == (100_000 - 15_000, 0)
    status = {r["request_id"]: r["status"] for r in await rows(me, reservations)}
    assert status == {"lost-1": "refunded", "lost-2": "refunded", "kept-alive": "open", "kept-mine": "open",
                      "closed": "refunded"}
    async with me.engine.connect() as conn:
        assert await key_window_spend(conn, key.id, lost_1.window_start or 0) == (0, 7_000)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "lost-1" in logged and "lost-2" in logged and crashed.instance_id in logged
    assert "kept" not in logged

    # a second pass (the periodic one, or another instance doing the same) changes nothing
    assert await instances.reconcile_abandoned(me) == 0
    assert await instances.reconcile_abandoned(alive) == 0
    assert await pockets(me, account) == (100_000 - 15_000, 0)
    # the crashed instance's requests can no longer be settled, and are not refunded twice
    assert await billing.refund(crashed, lost_2) is False
    assert await settle_paid(crashed, lost_1, PRICED, Usage(prompt_tokens=1, completion_tokens=1),
                                billing.Served("prov_x", None)) is None

    # once the other instance goes quiet too, its reservation follows
    await _age(alive, alive.instance_id, 60)
    assert await instances.reconcile_abandoned(me) == 1
    assert {r["request_id"]: r["status"] for r in await rows(me, reservations)}["kept-alive"] == "refunded"
    assert await pockets(me, account) == (100_000 - 8_000, 0)
    assert kept_alive.amount == 7_000 and kept_mine.amount == 8_000 and lost_2.amount == 6_000
    await check_ledger_consistency(me.engine)


async def test_reservations_of_an_instance_that_never_registered_are_abandoned(make_services: MakeServices) -> None:
    ghost = await make_services()
    me = await make_services()
    await instances.register_instance(me)
    account = await new_account(me, credit=10_000)
    await billing.reserve(ghost, "ghost", account, None, 2_500)
    assert await instances.reconcile_abandoned(me) == 1
    assert await pockets(me, account) == (10_000, 0)


async def test_a_fresh_heartbeat_keeps_an_instance_alive(make_services: MakeServices) -> None:
    other = await make_services(instance_stale_after=2)
    me = await make_services(instance_stale_after=2)
    await instances.register_instance(other)
    await instances.register_instance(me)
    account = await new_account(me, credit=10_000)
    await billing.reserve(other, "other", account, None, 2_500)
    assert await instances.reconcile_abandoned(me) == 0
    await _age(other, other.instance_id, 3)
    assert await instances.reconcile_abandoned(me) == 1
    assert await pockets(me, account) == (10_000, 0)


async def test_own_reservations_older_than_any_request_are_refunded(make_services: MakeServices) -> None:
    """A live instance whose settlement kept failing must not hold the money until it restarts: its
    own reservations older than the longest possible request are refunded; younger ones are kept."""
    me = await make_services(queue_max_wait=1, request_timeout=2, cancel_grace=1)
    await instances.register_instance(me)
    account = await new_account(me, credit=100_000)
    await billing.reserve(me, "stuck", account, None, 5_000)
    await billing.reserve(me, "running", account, None, 3_000)
    longest = instances.longest_request(me)
    async with me.engine.begin() as conn:
        await conn.execute(update(reservations).where(reservations.c.request_id == "stuck")
                           .values(created_at=int(time.time() - longest - 5)))
    assert await instances.reconcile_abandoned(me) == 1
    status = {r["request_id"]: r["status"] for r in await rows(me, reservations)}
    assert status == {"stuck": "refunded", "running": "open"}
    assert await pockets(me, account) == (100_000 - 3_000, 0)
    await check_ledger_consistency(me.engine)
