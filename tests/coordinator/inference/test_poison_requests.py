"""Poison requests (issue 19, row 1): a request whose attempt takes its provider's session down with
it before any output goes to one more session at most, and fails as ``request_crashed_providers``
when that one goes down too; it never walks the fleet.

A session "goes down" as its connection's ``close`` takes it down: out of the registry (no longer online),
then every attempt on it fails as ``provider_unavailable``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.inference.attempts import Attempts
from darkbloom.coordinator.inference.failures import ProviderFailure
from darkbloom.coordinator.routing.scheduler import try_place
from tests.coordinator.inference.test_attempts import REQUEST_ID, past_half_budget, start, total_active
from tests.coordinator.routing.sim import (SimProvider, chat, decision, dispatched, fleet, lifecycle, services,
                                          settings)


def crashed_count() -> float:
    return REGISTRY.get_sample_value("darkbloom_requests_crashed_providers_total") or 0.0


def crash(registry: Registry, provider: SimProvider) -> None:
    """The node died on the request: its socket closed, so its session leaves and its attempts fail."""
    registry.remove(provider.session)
    provider.session.disconnected()


async def retried_after_a_crash() -> tuple[Registry, list[SimProvider], asyncio.Task[Any], SimProvider,
                                       SimProvider]:
    """Three providers; the request's first session crashes on it, and its retry is on a second."""
    registry = Registry()
    providers = fleet(registry, 3)
    _, run = start(registry)
    first = await dispatched(providers)
    crash(registry, first)
    second = await dispatched([p for p in providers if p is not first])
    return registry, providers, run, first, second


async def test_two_sessions_taken_down_fail_the_request_by_name_and_spare_the_rest() -> None:
    before = crashed_count()
    registry, providers, run, first, second = await retried_after_a_crash()
    crash(registry, second)
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 2)
    error = failure.value.as_api_error({})
    assert (error.status, error.type, error.code) == (502, "provider_error", "request_crashed_providers")
    assert error.headers["x-should-retry"] == "false"
    third, = [p for p in providers if p not in (first, second)]
    assert third.requests() == [] and total_active(providers) == 0
    assert crashed_count() == before + 1


async def test_one_session_taken_down_is_retried_once_and_may_still_succeed() -> None:
    registry, providers, run, first, second = await retried_after_a_crash()
    second.reply(REQUEST_ID, "fine")
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is second.session


async def test_after_a_takedown_any_failure_of_the_one_retry_ends_the_request() -> None:
    """Not a third session, whatever the retry failed of (here a provider 503)."""
    registry, providers, run, first, second = await retried_after_a_crash()
    second.error(REQUEST_ID, 503)
    with pytest.raises(ProviderFailure) as failure:
        await asyncio.wait_for(run, 2)
    assert failure.value.failure.reason == "provider_error"
    third, = [p for p in providers if p not in (first, second)]
    assert third.requests() == []


async def test_the_retry_after_a_takedown_gets_no_backup() -> None:
    registry, providers, run, first, second = await retried_after_a_crash()
    await past_half_budget()  # a backup would have started by now
    third, = [p for p in providers if p not in (first, second)]
    assert third.requests() == []
    second.reply(REQUEST_ID)
    await asyncio.wait_for(run, 2)


async def test_failures_that_leave_the_session_up_are_retried_as_before() -> None:
    """A disconnect reported for a session still online (a holder's busy slot) is no takedown."""
    registry = Registry()
    providers = fleet(registry, 3)
    _, run = start(registry)
    tried = []
    for _ in range(2):
        provider = await dispatched([p for p in providers if p not in tried])
        tried.append(provider)
        provider.gone(REQUEST_ID)
    last, = [p for p in providers if p not in tried]
    await last.next_request()
    last.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is last.session


async def test_a_session_gone_before_the_request_went_out_is_no_takedown() -> None:
    registry = Registry()
    providers = fleet(registry, 3)
    route = decision()
    svc = services(registry, settings(first_content_timeout=30.0))
    placement = try_place(registry, route, svc.settings)
    assert placement is not None
    gone, = [p for p in providers if p.session is placement.session]
    registry.remove(gone.session)  # placed, then disconnected before dispatch
    attempts = Attempts(lifecycle(svc, REQUEST_ID), route, "chat", chat().node_body(64))
    run = asyncio.ensure_future(attempts.run(placement))
    second = await dispatched([p for p in providers if p is not gone])
    crash(registry, second)
    third, = [p for p in providers if p not in (gone, second)]
    await third.next_request()  # one takedown so far: one more session may still be tried
    third.reply(REQUEST_ID)
    pending, _ = await asyncio.wait_for(run, 2)
    assert pending.session is third.session
