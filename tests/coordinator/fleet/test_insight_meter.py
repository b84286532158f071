"""Machine insight's meter: how busy a machine was and how fast it decoded are counted in time, each
span when it ends, so an idle fleet costs nothing per machine per flush, while what a stats read
returns is the machine's time up to the read."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.insight import KEPT_HOURS, MachineInsight, hour_of, tps_bucket
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.store import insight
from tests.coordinator.routing.sim import SimProvider, fleet
from tests.support.held_write import HeldWrite

START = 1_800_000_000.0 + 600  # ten minutes into an hour


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def _metered(engine: AsyncEngine) -> tuple[Registry, MachineInsight, Clock]:
    registry, clock = Registry(), Clock()
    return registry, MachineInsight(registry, engine, interval=10, clock=clock), clock


async def _counters(engine: AsyncEngine, machine_id: str, since: float = 0) -> dict[str, int]:
    async with engine.connect() as conn:
        return await insight.counters(conn, machine_id, int(since))


async def _rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return len((await conn.exec_driver_sql("SELECT machine_id FROM machine_insight")).all())


async def test_busy_slots_and_slots_are_counted_in_time(engine: AsyncEngine) -> None:
    registry, meter, clock = _metered(engine)
    [node] = fleet(registry, 1, machine="mach_a", max_concurrency=2)
    clock.now += 30
    node.set_active(1)  # idle 30 s
    clock.now += 60
    node.set_active(2)  # one of two slots busy for 60 s
    clock.now += 15
    node.set_active(0)  # both busy for 15 s
    clock.now += 45     # idle again for 45 s, counted by the read
    await meter.flush(machine_id="mach_a")
    counters = await _counters(engine, "mach_a")
    assert counters["slot_ms"] == 2 * 150_000
    assert counters["busy_slot_ms"] == 1 * 60_000 + 2 * 15_000


async def test_an_idle_fleet_is_not_counted_at_every_flush(engine: AsyncEngine) -> None:
    registry, meter, clock = _metered(engine)
    fleet(registry, 200, machine="mach_idle")
    [busy] = fleet(registry, 1, machine="mach_busy", max_concurrency=4)
    busy.set_active(3)
    clock.now += 10
    await meter.flush()
    # the busy machine's time so far, and nothing of the 200 idle sessions
    assert await _counters(engine, "mach_busy") == {"slot_ms": 40_000, "busy_slot_ms": 30_000}
    assert await _counters(engine, "mach_idle") == {}
    clock.now += MachineInsight.IDLE_COUNT
    await meter.flush()
    assert (await _counters(engine, "mach_idle"))["slot_ms"] == 200 * (MachineInsight.IDLE_COUNT + 10) * 1000
    counted = await _counters(engine, "mach_idle")
    clock.now += 10
    await meter.flush()
    assert await _counters(engine, "mach_idle") == counted  # each counted once per IDLE_COUNT: not yet again


async def test_a_span_across_the_hour_goes_to_each_hour_it_covers(engine: AsyncEngine) -> None:
    registry, meter, clock = _metered(engine)
    [node] = fleet(registry, 1, machine="mach_a")
    node.set_active(1)
    clock.now = hour_of(START) + 3600 + 120  # 50 minutes left in the first hour, 2 in the next
    node.set_active(0)
    await meter.flush()
    first, second = hour_of(START), hour_of(START) + 3600
    assert await _counters(engine, "mach_a", second) == {"slot_ms": 120_000, "busy_slot_ms": 120_000}
    totals = await _counters(engine, "mach_a", first)
    assert totals == {"slot_ms": 3_120_000, "busy_slot_ms": 3_120_000}


async def test_the_decode_speed_is_weighted_by_the_time_the_machine_had_it(engine: AsyncEngine) -> None:
    registry, meter, clock = _metered(engine)
    [node] = fleet(registry, 1, machine="mach_a")
    clock.now += 100  # not measured yet: no speed
    node.session.report_speed(20.0)
    clock.now += 100
    node.session.report_speed(80.0)
    clock.now += 300
    await meter.flush(machine_id="mach_a")
    counters = await _counters(engine, "mach_a")
    assert counters[f"tps_ms:{tps_bucket(20.0)}"] == 100_000
    assert counters[f"tps_ms:{tps_bucket(80.0)}"] == 300_000
    assert counters["slot_ms"] == 500_000


async def test_a_session_that_leaves_is_counted_up_to_then(engine: AsyncEngine) -> None:
    registry, meter, clock = _metered(engine)
    [node] = fleet(registry, 1, machine="mach_a", max_concurrency=3)
    clock.now += 40
    registry.remove(node.session)
    clock.now += 1000  # offline: not counted
    await meter.flush()
    assert await _counters(engine, "mach_a") == {"slot_ms": 120_000}
    unowned = SimProvider()  # no machine: nothing to count it on
    registry.add(unowned.session)
    clock.now += 1000
    await meter.flush(everything=True)
    assert await _rows(engine) == 1


async def test_a_failed_write_is_kept_for_the_next(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    registry, meter, clock = _metered(engine)
    [node] = fleet(registry, 1, machine="mach_a")
    node.set_active(1)
    clock.now += 10

    async def refused(*_args: object) -> None:
        raise OSError("the database is away")
    with monkeypatch.context() as patch:
        patch.setattr(insight, "add", refused)
        with pytest.raises(OSError):
            await meter.flush()
    clock.now += 10
    await meter.flush()
    assert await _counters(engine, "mach_a") == {"slot_ms": 20_000, "busy_slot_ms": 20_000}


async def test_stopping_waits_for_a_write_under_way_rather_than_cancelling_it(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction cancelled mid-statement can stay open on the server and hold the rows the last
    write at shutdown needs: the flusher's stop lets a write under way end first."""
    registry = Registry()
    meter = MachineInsight(registry, engine, interval=0.01)
    [node] = fleet(registry, 1, machine="mach_a")
    node.set_active(1)  # busy: counted at every flush
    held = HeldWrite(insight.add)
    monkeypatch.setattr(insight, "add", held)
    meter.start()
    await asyncio.wait_for(held.entered.wait(), 5)
    closing = asyncio.ensure_future(meter.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # waiting for the write, not cancelling it
    held.release.set()
    await asyncio.wait_for(closing, 5)
    assert held.outcomes and "cancelled" not in held.outcomes
    assert (await _counters(engine, "mach_a"))["slot_ms"] > 0


async def test_counters_older_than_the_longest_stats_window_are_deleted_once_an_hour(engine: AsyncEngine) -> None:
    """The table follows the fleet, not its age: the first write of each hour deletes the hours no
    stats read can reach (``hours`` ≤ KEPT_HOURS), and keeps the oldest one it can."""
    registry, meter, clock = _metered(engine)
    now_hour = hour_of(START)
    oldest_read = now_hour - (KEPT_HOURS - 1) * 3600
    async with engine.begin() as conn:
        await insight.add(conn, {("mach_a", oldest_read - 3600, "slot_ms"): 1, ("mach_a", oldest_read, "slot_ms"): 2,
                                 ("mach_a", now_hour, "slot_ms"): 3})
    await meter.flush()  # nothing pending, but the first write of the hour
    assert await _counters(engine, "mach_a") == {"slot_ms": 2 + 3}
    async with engine.begin() as conn:
        await insight.add(conn, {("mach_a", oldest_read - 7200, "slot_ms"): 4})
    clock.now += 60
    await meter.flush()  # the same hour: not again
    assert await _counters(engine, "mach_a") == {"slot_ms": 4 + 2 + 3}
    clock.now += 3600
    await meter.flush()  # the next hour: the hour that was the oldest readable goes too
    assert await _counters(engine, "mach_a") == {"slot_ms": 3}
