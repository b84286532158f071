"""The node's one concurrency limit, shared by fleet (try_acquire) and direct-mode (acquire) requests."""

from __future__ import annotations

import asyncio

import pytest

from darkbloom.provider.slots import Slots


async def queued(slots: Slots, count: int) -> None:
    """Until ``count`` requests wait for a slot (a waiter queues in its task's first loop turn)."""
    for _ in range(100):
        if slots.waiting >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{slots.waiting} waiting, not {count}")


async def test_try_acquire_stops_at_the_limit_and_release_frees() -> None:
    slots = Slots(2)
    assert slots.try_acquire() and slots.try_acquire()
    assert not slots.try_acquire()
    assert slots.active == 2
    slots.release()
    assert slots.active == 1 and slots.try_acquire()


async def test_a_waiting_direct_request_gets_the_freed_slot_before_a_fleet_request() -> None:
    slots = Slots(1)
    assert slots.try_acquire()  # a fleet request holds the only slot
    waiter = asyncio.create_task(slots.acquire(timeout=30))
    await queued(slots, 1)
    assert not waiter.done() and slots.waiting == 1
    assert not slots.try_acquire()  # a fleet request arriving now is refused while one waits
    slots.release()
    assert await waiter is True
    assert slots.active == 1 and not slots.try_acquire()
    slots.release()
    assert slots.active == 0


async def test_waiters_are_served_first_come_first_served() -> None:
    slots = Slots(1)
    assert await slots.acquire(timeout=1)
    order: list[str] = []

    async def wait(name: str) -> None:
        assert await slots.acquire(timeout=30)
        order.append(name)

    first = asyncio.create_task(wait("first"))
    await queued(slots, 1)
    second = asyncio.create_task(wait("second"))
    await queued(slots, 2)
    slots.release()
    await first
    slots.release()
    await second
    assert order == ["first", "second"]


async def test_a_wait_that_runs_out_returns_false_and_leaves_no_trace() -> None:
    slots = Slots(1)
    assert slots.try_acquire()
    assert await slots.acquire(timeout=0.05) is False
    assert slots.waiting == 0 and slots.active == 1
    slots.release()
    assert slots.active == 0 and slots.try_acquire()


async def test_a_cancelled_waiter_does_not_keep_a_handed_over_slot() -> None:
    slots = Slots(1)
    assert slots.try_acquire()
    waiter = asyncio.create_task(slots.acquire(timeout=30))
    await queued(slots, 1)
    slots.release()  # handed to the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.active == 0 and slots.try_acquire()


def test_releasing_more_than_acquired_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        Slots(1).release()
