"""The per-model queue: fail fast, depth, timeout, drain order, waiters that cannot be placed,
cancelled waiters, and the drain tick (docs/routing.md "Fail fast, or queue")."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import pytest

from darkbloom.coordinator.routing import queue as queueing
from darkbloom.coordinator.routing.queue import NoEligibleSession, QueueRefused, RequestQueues
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.scheduler import Claim
from darkbloom.coordinator.routing.decision import RouteDecision
from tests.coordinator.routing.sim import MODEL, SimProvider, decision, fleet, settings

OWNER = "acct_owner"


def queues(registry: Registry, **fields: Any) -> RequestQueues:
    return RequestQueues(registry, settings(**fields))


async def enqueue(q: RequestQueues, d: RouteDecision) -> asyncio.Task[Claim]:
    """Start ``place`` and let it reach the queue."""
    task = asyncio.ensure_future(q.place(d))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "expected the request to wait in the queue"
    return task


def free(provider: SimProvider, q: RequestQueues) -> None:
    """A slot frees, as when an attempt is released: the release itself wakes the queue."""
    provider.held.pop().release()


async def a_tick(q: RequestQueues) -> None:
    """Until the tick (``drain_forever``, which calls ``q.drain``) has drained the queues once more."""
    drained = asyncio.Event()
    drain = q.drain

    def counted() -> None:
        drain()
        drained.set()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(q, "drain", counted)
        await asyncio.wait_for(drained.wait(), 10 * queueing.DRAIN_TICK)


@contextlib.asynccontextmanager
async def ticking(q: RequestQueues) -> AsyncIterator[None]:
    task = asyncio.ensure_future(q.drain_forever())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_free_session_is_placed_at_once() -> None:
    registry = Registry()
    provider, = fleet(registry, 1)
    q = queues(registry)
    placement = await q.place(decision())
    assert placement.session is provider.session and provider.session.active == 1
    assert q.depth(MODEL.id) == 0


async def test_nothing_eligible_fails_fast() -> None:
    registry = Registry()
    q = queues(registry)
    with pytest.raises(NoEligibleSession) as empty:
        await q.place(decision())
    assert empty.value.survey.eligible == []
    fleet(registry, 1, untrusted="bad signature")
    fleet(registry, 1, private_only=True, account=OWNER)
    with pytest.raises(NoEligibleSession) as blocked:
        await q.place(decision())
    assert blocked.value.survey.reasons == {"untrusted": 1, "private_only": 1}
    assert q.depth(MODEL.id) == 0


async def test_busy_but_eligible_waits_then_gets_the_freed_slot() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry)
    waiter = await enqueue(q, decision())
    assert q.depth(MODEL.id) == 1
    free(provider, q)
    placement = await asyncio.wait_for(waiter, 1)
    assert placement.session is provider.session and provider.session.active == 1
    assert q.depth(MODEL.id) == 0


async def test_queue_full() -> None:
    registry = Registry()
    fleet(registry, 1, active=1)
    q = queues(registry, queue_depth=2)
    waiters = [await enqueue(q, decision()), await enqueue(q, decision())]
    with pytest.raises(QueueRefused) as refused:
        await q.place(decision())
    assert refused.value.code == "queue_full" and refused.value.retry_after >= 1
    assert q.depth(MODEL.id) == 2
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_depth_zero_never_queues() -> None:
    registry = Registry()
    fleet(registry, 1, active=1)
    with pytest.raises(QueueRefused) as refused:
        await queues(registry, queue_depth=0).place(decision())
    assert refused.value.code == "queue_full"


async def test_queue_timeout_leaves_the_queue() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry, queue_max_wait=0.2)
    waiter = await enqueue(q, decision())
    with pytest.raises(QueueRefused) as refused:
        await asyncio.wait_for(waiter, 2)
    assert refused.value.code == "queue_timeout" and refused.value.retry_after >= 1
    assert refused.value.survey is not None and refused.value.survey.reasons == {"no_free_slot": 1}
    assert q.depth(MODEL.id) == 0
    free(provider, q)
    assert provider.session.active == 0  # the timed-out waiter claimed nothing


async def test_drain_in_arrival_order() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry)
    waiters = [await enqueue(q, decision()) for _ in range(3)]
    for index, waiter in enumerate(waiters):
        free(provider, q)
        assert q.depth(MODEL.id) == 2 - index
        placement = await asyncio.wait_for(waiter, 1)
        assert placement.session is provider.session
        provider.held.append(placement.slot)  # it now holds the one slot, until the next free()
        assert not any(later.done() for later in waiters[index + 1:])


async def test_a_waiter_that_cannot_be_placed_keeps_its_place() -> None:
    registry = Registry()
    a, b = fleet(registry, 2, active=1)
    q = queues(registry)
    picky = await enqueue(q, decision(excluded={a.id}))  # already failed on A: only B will do
    plain = await enqueue(q, decision())
    free(a, q)  # A frees: the picky waiter is skipped, the later one placed
    assert (await asyncio.wait_for(plain, 1)).session is a.session
    assert not picky.done() and q.depth(MODEL.id) == 1
    third = await enqueue(q, decision())  # arrives after the picky waiter, behind it
    free(b, q)
    assert (await asyncio.wait_for(picky, 1)).session is b.session
    assert not third.done() and q.depth(MODEL.id) == 1
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)


async def test_an_exclusive_waiter_never_takes_a_public_slot() -> None:
    registry = Registry()
    owned, = fleet(registry, 1, account=OWNER, active=1)
    public, = fleet(registry, 1, active=1)
    q = queues(registry)
    exclusive = await enqueue(q, decision(owner_account_id=OWNER, owned_only=True))
    later_public = await enqueue(q, decision())
    free(public, q)
    assert (await asyncio.wait_for(later_public, 1)).session is public.session
    assert not exclusive.done()
    free(owned, q)
    placement = await asyncio.wait_for(exclusive, 1)
    assert placement.session is owned.session and placement.owned


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry)
    gone = await enqueue(q, decision())
    stays = await enqueue(q, decision())
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert q.depth(MODEL.id) == 1
    free(provider, q)
    assert (await asyncio.wait_for(stays, 1)).session is provider.session
    assert provider.session.active == 1


async def test_a_waiter_cancelled_after_placement_gives_the_slot_back() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry)
    waiter = await enqueue(q, decision())
    free(provider, q)  # placed: the slot is claimed for it …
    assert provider.session.active == 1
    waiter.cancel()  # … but its client left before it resumed
    await asyncio.gather(waiter, return_exceptions=True)
    assert provider.session.active == 0 and q.depth(MODEL.id) == 0


async def test_the_tick_places_waiters_when_a_session_registers() -> None:
    registry = Registry()
    fleet(registry, 1, active=1)
    q = queues(registry)
    waiter = await enqueue(q, decision())
    async with ticking(q):
        newcomer, = fleet(registry, 1)  # nobody calls drain(): the tick must notice
        placement = await asyncio.wait_for(waiter, 10 * queueing.DRAIN_TICK)
    assert placement.session is newcomer.session


async def test_the_tick_sleeps_while_nothing_waits_and_wakes_when_a_request_queues(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle coordinator does not wake four times a second for empty queues."""
    monkeypatch.setattr(queueing, "DRAIN_TICK", 0.001)
    registry = Registry()
    fleet(registry, 1, active=1)
    q = queues(registry)
    drains = 0
    drain = q.drain

    def counted() -> None:
        nonlocal drains
        drains += 1
        drain()

    monkeypatch.setattr(q, "drain", counted)
    async with ticking(q):
        for _ in range(20):
            await asyncio.sleep(0.002)  # twenty ticks' worth with nothing queued
        assert drains == 0
        waiter = await enqueue(q, decision())
        drains_on_arrival = drains  # place() drains once itself
        newcomer, = fleet(registry, 1)
        placement = await asyncio.wait_for(waiter, 10)  # only the tick can place it
        assert drains > drains_on_arrival and placement.session is newcomer.session


async def test_the_tick_places_waiters_when_trust_changes() -> None:
    registry = Registry()
    _busy, = fleet(registry, 1, active=1)
    stale, = fleet(registry, 1, challenge_age=None)  # eligible later, when it passes a challenge
    q = queues(registry)
    waiter = await enqueue(q, decision())
    async with ticking(q):
        await a_tick(q)  # it drained and left the waiter queued, no slot claimed
        assert q.depth(MODEL.id) == 1 and stale.session.active == 0 and not waiter.done()
        stale.session.record_challenge_pass(time.monotonic())
        placement = await asyncio.wait_for(waiter, 10 * queueing.DRAIN_TICK)
    assert placement.session is stale.session


async def test_retry_after_follows_the_recent_wait() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry, queue_depth=1)
    waiter = await enqueue(q, decision())
    await asyncio.sleep(1.2)
    free(provider, q)
    await waiter
    waiter2 = await enqueue(q, decision())
    with pytest.raises(QueueRefused) as refused:
        await q.place(decision())
    assert refused.value.retry_after >= 2  # ceil of the last wait (≥ 1.2 s), not the 1 s default
    waiter2.cancel()
    await asyncio.gather(waiter2, return_exceptions=True)


# batch lines: the lowest priority (docs/batches.md "Priority")

async def test_a_batch_line_leaves_a_slot_free_for_live_requests() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, max_concurrency=4)
    q = queues(registry)
    lines = [await q.place(decision(batch=True)) for _ in range(3)]
    assert provider.session.active == 3
    waiting = await enqueue(q, decision(batch=True))  # the fourth slot is kept for live requests
    live = await q.place(decision())
    assert live.session is provider.session and provider.session.active == 4
    lines[0].slot.release()
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a slot is still kept free beside the live request
    lines[1].slot.release()
    placed = await asyncio.wait_for(waiting, 1)
    assert placed.session is provider.session and provider.session.active == 3
    assert q.depth(MODEL.id) == 0  # batch lines never count towards a live queue's depth


async def test_a_session_with_one_slot_still_runs_batch_lines() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, max_concurrency=1)
    placed = await queues(registry).place(decision(batch=True))
    assert placed.session is provider.session


async def test_a_freed_slot_goes_to_a_live_waiter_before_any_batch_line() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, active=1)
    q = queues(registry)
    line = await enqueue(q, decision(batch=True))  # waiting first
    live = await enqueue(q, decision())
    free(provider, q)
    served = await asyncio.wait_for(live, 1)
    assert served.session is provider.session
    assert not line.done()
    served.slot.release()
    assert (await asyncio.wait_for(line, 1)).session is provider.session


async def test_batch_lines_do_not_fill_a_live_queue() -> None:
    registry = Registry()
    fleet(registry, 1, active=1)
    q = queues(registry, queue_depth=1)
    lines = [await enqueue(q, decision(batch=True)) for _ in range(3)]
    live = await enqueue(q, decision())
    with pytest.raises(QueueRefused):
        await q.place(decision())  # the live queue is full with one live waiter, not with batch lines
    for task in (*lines, live):
        task.cancel()
    await asyncio.gather(*lines, live, return_exceptions=True)
