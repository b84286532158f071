"""Getting to first content: sequential retry and the speculative backup, driven frame by frame.

Each simulated session's ``outbox`` shows what the coordinator sent it (``inference_request``,
``cancel``); the test answers for the provider by calling the ``Attempt`` (the inbox it opened) with
chunks sealed to the request's reply key. ``first_content_timeout`` is 0.4 s (backup at 0.2 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from darkbloom.coordinator.inference.attempts import MAX_ATTEMPTS, Attempt, Attempts
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.inference.failures import ProviderFailure
from darkbloom.coordinator.routing.scheduler import try_place
from darkbloom.coordinator.routing.decision import RouteDecision
from tests.coordinator.routing.sim import (SimProvider, chat, decision, dispatched, end_as_gone, fleet, lifecycle,
                                          services, settings)

REQUEST_ID = "chatcmpl-sim"
OWNER = "acct_owner"
BUDGET = 0.4


def start(registry: Registry, route: RouteDecision | None = None,
          **settings_fields: Any) -> tuple[Attempts, asyncio.Task[tuple[Attempt, bool]]]:
    """Place the request on a session (the first placement, as the queue would) and run its attempts."""
    route = route or decision()
    svc = services(registry, settings(first_content_timeout=BUDGET, **settings_fields))
    placement = try_place(registry, route, svc.settings)
    assert placement is not None
    attempts = Attempts(lifecycle(svc, REQUEST_ID), route, "chat", chat().node_body(64))
    return attempts, asyncio.ensure_future(attempts.run(placement))


async def past_half_budget() -> None:
    """Return once a request started now has got its backup (at half its budget): any request that
    started earlier is past half its budget too, its own backup decision made (the loop fires timers
    in deadline order). A witness on a fleet of its own, cancelled afterwards."""
    registry = Registry()
    providers = fleet(registry, 2)
    attempts, run = start(registry)
    primary = await dispatched(providers)
    backup, = [p for p in providers if p is not primary]
    await backup.next_request(timeout=25 * BUDGET)  # a bound on a hang (a loaded machine fires timers late)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await end_as_gone(attempts.life)


def total_active(providers: list[SimProvider]) -> int:
    return sum(p.session.active for p in providers)


async def test_first_attempt_succeeds_and_holds_its_slot() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    primary = await dispatched(providers)
    assert primary.body(REQUEST_ID)["stream"] is True  # sealed to this provider's key
    primary.reply(REQUEST_ID, "hello")
    pending, completed = await asyncio.wait_for(run, 2)
    assert pending.session is primary.session and not completed
    assert pending.head[0]["choices"][0]["delta"]["content"] == "hello"
    assert total_active(providers) == 1 and primary.session.active == 1


async def test_retry_excludes_failed_sessions() -> None:
    registry = Registry()
    providers = fleet(registry, 3)
    route = decision()
    _attempts, run = start(registry, route)
    first = await dispatched(providers)
    first.error(REQUEST_ID, 502)
    second = await dispatched([p for p in providers if p is not first])
    second.gone(REQUEST_ID)  # the provider disconnected
    third = await dispatched([p for p in providers if p not in (first, second)])
    third.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is third.session
    assert route.excluded == {first.id, second.id}
    assert first.session.active == second.session.active == 0 and third.session.active == 1
    assert first.requests() == second.requests() == [REQUEST_ID]  # each tried once


async def test_at_most_three_attempts_and_no_slot_leaks() -> None:
    registry = Registry()
    providers = fleet(registry, MAX_ATTEMPTS + 1)
    _, run = start(registry)
    tried: list[SimProvider] = []
    for _ in range(MAX_ATTEMPTS):
        provider = await dispatched([p for p in providers if p not in tried])
        tried.append(provider)
        provider.error(REQUEST_ID, 503)
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 2)
    assert failure.value.failure.status == 503
    untried, = [p for p in providers if p not in tried]
    assert untried.requests() == []
    assert total_active(providers) == 0  # nothing claimed for a fourth attempt that never runs


async def test_a_provider_4xx_is_not_retried() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    first = await dispatched(providers)
    first.error(REQUEST_ID, 400, "bad request")
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 2)
    assert failure.value.as_api_error().status == 400
    other, = [p for p in providers if p is not first]
    assert other.requests() == [] and total_active(providers) == 0


async def test_a_busy_provider_429_is_retried() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    first = await dispatched(providers)
    first.error(REQUEST_ID, 429, "busy")
    second = await dispatched([p for p in providers if p is not first])
    second.reply(REQUEST_ID)
    assert (await asyncio.wait_for(run, 2))[0].session is second.session


async def test_retries_never_queue() -> None:
    registry = Registry()
    lone, = fleet(registry, 1)
    fleet(registry, 1, active=1)  # eligible but busy
    _, run = start(registry)
    await lone.next_request()
    lone.error(REQUEST_ID, 500)
    with pytest.raises(ProviderFailure):
        await asyncio.wait_for(run, 2)


async def test_no_first_content_within_the_budget_fails_and_cancels() -> None:
    registry = Registry()
    lone, = fleet(registry, 1)
    _, run = start(registry)
    await lone.next_request()
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 5 * BUDGET)
    assert failure.value.failure.reason == "provider_timeout"
    assert lone.cancels() == [REQUEST_ID] and lone.session.active == 0


async def test_backup_when_the_primary_is_slow_and_another_is_idle() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    primary = await dispatched(providers)
    backup, = [p for p in providers if p is not primary]
    await backup.next_request(timeout=5 * BUDGET)  # sent after half the budget, same request id
    assert primary.cancels() == []
    backup.reply(REQUEST_ID, "from the backup")
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is backup.session
    assert primary.cancels() == [REQUEST_ID]  # the loser is told to stop …
    assert primary.session.active == 0 and backup.session.active == 1  # … and its slot freed
    assert backup.cancels() == []


async def test_the_primary_can_still_win_the_race() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    primary = await dispatched(providers)
    backup, = [p for p in providers if p is not primary]
    await backup.next_request(timeout=5 * BUDGET)
    primary.reply(REQUEST_ID, "late but first")
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is primary.session
    assert backup.cancels() == [REQUEST_ID] and backup.session.active == 0


async def test_no_backup_when_the_primary_answers_in_time() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    primary = await dispatched(providers)
    primary.reply(REQUEST_ID)
    await asyncio.wait_for(run, 2)
    await past_half_budget()
    other, = [p for p in providers if p is not primary]
    assert other.requests() == [] and primary.cancels() == []


async def test_no_backup_when_no_other_session_is_idle() -> None:
    registry = Registry()
    primary, = fleet(registry, 1, max_concurrency=4)
    serving, = fleet(registry, 1, max_concurrency=4, active=1)  # a free slot, but not idle
    route = decision()
    svc = services(registry, settings(first_content_timeout=BUDGET))
    placement = try_place(registry, route, svc.settings)
    assert placement is not None and placement.session is primary.session  # the idle one wins selection
    attempts = Attempts(lifecycle(svc, REQUEST_ID), route, "chat", chat().node_body(64))
    run = asyncio.ensure_future(attempts.run(placement))
    await primary.next_request()
    await past_half_budget()
    primary.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is primary.session
    assert serving.requests() == [] and serving.session.active == 1


async def test_both_silent_fails_and_cancels_both() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    _, run = start(registry)
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 10 * BUDGET)
    assert failure.value.failure.reason == "provider_timeout"
    assert all(p.requests() == [REQUEST_ID] and p.cancels() == [REQUEST_ID] for p in providers)
    assert total_active(providers) == 0


async def test_an_owned_primary_gets_no_public_backup() -> None:
    """A prefer request served by an owned machine: a backup only on another owned one, never paid."""
    registry = Registry()
    owned, = fleet(registry, 1, account=OWNER)
    public = fleet(registry, 2, decode_tps=1000.0)
    route = decision(owner_account_id=OWNER)
    _, run = start(registry, route)
    await owned.next_request()
    await past_half_budget()
    owned.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is owned.session
    assert all(p.requests() == [] for p in public)


async def test_an_exclusive_retry_stays_on_owned_sessions() -> None:
    registry = Registry()
    owned = fleet(registry, 2, account=OWNER)
    public = fleet(registry, 2)
    route = decision(owner_account_id=OWNER, owned_only=True)
    _, run = start(registry, route)
    first = await dispatched(owned)
    first.error(REQUEST_ID, 500)
    second, = [p for p in owned if p is not first]
    await second.next_request()
    second.error(REQUEST_ID, 500)
    with pytest.raises(ProviderFailure):
        await asyncio.wait_for(run, 2)
    assert all(p.requests() == [] for p in public)


async def test_a_session_gone_before_dispatch_fails_over_at_once() -> None:
    """Placed, then disconnected before the request went out: no waiting for a dead socket."""
    registry = Registry()
    providers = fleet(registry, 2)
    route = decision()
    svc = services(registry, settings(first_content_timeout=30.0))
    placement = try_place(registry, route, svc.settings)
    assert placement is not None
    registry.remove(placement.session)  # what the connection's close does; it had no pending request yet
    attempts = Attempts(lifecycle(svc, REQUEST_ID), route, "chat", chat().node_body(64))
    run = asyncio.ensure_future(attempts.run(placement))
    other, = [p for p in providers if p.session is not placement.session]
    await other.next_request(timeout=2)
    other.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is other.session
    assert placement.session.active == 0


async def test_the_lifecycle_end_cancels_primary_and_backup() -> None:
    registry = Registry()
    providers = fleet(registry, 2)
    attempts, run = start(registry)
    primary = await dispatched(providers)
    backup, = [p for p in providers if p is not primary]
    await backup.next_request(timeout=5 * BUDGET)
    run.cancel()  # the client went away
    await asyncio.gather(run, return_exceptions=True)
    await end_as_gone(attempts.life)
    assert primary.cancels() == [REQUEST_ID] and backup.cancels() == [REQUEST_ID]
    assert total_active(providers) == 0


async def test_a_cancel_racing_a_provider_event_is_not_swallowed() -> None:
    """The client leaves in the same instant the provider fails: the attempts stop there; no retry
    is dispatched (and no slot claimed) after the caller has abandoned them."""
    registry = Registry()
    providers = fleet(registry, 2)
    attempts, run = start(registry)
    first = await dispatched(providers)
    first.error(REQUEST_ID, 502)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await end_as_gone(attempts.life)  # the attempts have ended: nothing is left to dispatch a retry
    assert run.cancelled()
    other, = [p for p in providers if p is not first]
    assert other.requests() == [] and total_active(providers) == 0
