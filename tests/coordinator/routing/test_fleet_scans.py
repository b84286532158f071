"""Requests do not scan the fleet (issue 21): placement, GET /v1/models, /v1/me/self-route-models,
/v1/me/providers and the Self-Route pre-flight read the same number of sessions whether the fleet
around the caller's candidates holds 10 sessions or 1,000; nor does the once-a-second eviction check.

A session is counted as visited when any of its attributes is read during the request (its class is
swapped for one that records the read), so a pass over a registry index, a gate or a listing all count.
A view is opened on its first request (one pass over the model's or the owner's sessions, once): each
test makes one request before the one it counts.
"""

from __future__ import annotations

import gc
import inspect
import random
import time
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.machines import linked_machines
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.model_views import list_models, owned_models
from darkbloom.coordinator.routing.decision import Policy
from darkbloom.coordinator.routing.route import check_context, place
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts, create_engine, machines, migrate
from darkbloom.wire.openai.errors import ApiError
from tests.coordinator.routing.sim import MODEL, NoLifecycle, SimProvider, decision, fleet, services, settings

OWNER = "acct_owner"
OTHER = "acct_other"
SIZES = (10, 1000)
_visited: set[int] = set()


class _Visited(ProviderSession):
    """A session that records every read of its attributes."""

    def __getattribute__(self, name: str) -> Any:
        _visited.add(id(self))
        return object.__getattribute__(self, name)


def counted(providers: list[SimProvider]) -> list[SimProvider]:
    for provider in providers:
        provider.session.__class__ = _Visited
    return providers


def crowd(registry: Registry, size: int) -> None:
    """``size`` sessions of each kind a request must not walk: other models, other owners' private
    machines, untrusted, unverified runtimes, busy ones of another model, and idle candidates of
    the public model (of which a request needs one)."""
    counted(fleet(registry, size, models=("other-model",)))
    counted(fleet(registry, size, private_only=True, account=OTHER, machine="mach_other"))
    counted(fleet(registry, size, untrusted="a chunk that does not open"))
    counted(fleet(registry, size, runtime_verified=False))
    counted(fleet(registry, size, models=("other-model",), active=1))
    counted(fleet(registry, size, account=OTHER))


async def visits(request: Callable[[], Awaitable[Any] | Any]) -> int:
    """Sessions read by the second of two identical requests (the first opens the views)."""
    for _ in range(2):
        _visited.clear()
        result = request()
        if inspect.isawaitable(result):
            await result
    return len(_visited)


async def at_each_size(request_for: Callable[[Registry, int], Callable[[], Any]]) -> list[int]:
    counts = []
    for size in SIZES:
        registry = Registry()
        crowd(registry, size)
        counts.append(await visits(request_for(registry, size)))
    return counts


async def test_placement_reads_one_candidate_however_many_there_are() -> None:
    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)

        async def placed() -> None:
            claim = await place(svc, decision(), Policy("public", None), NoLifecycle())
            claim.slot.release()
        return placed

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] <= 2, counts


async def test_a_model_nobody_can_serve_is_refused_without_a_survey() -> None:
    """Blocked sessions of the model (untrusted, private, unverified) are not walked to say 503."""
    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)
        counted(fleet(registry, size, models=("blocked-model",), untrusted="failed a challenge"))
        counted(fleet(registry, size, models=("blocked-model",), private_only=True, account=OTHER))
        blocked = decision(model=MODEL.model_copy(update={"id": "blocked-model", "aliases": []}))

        async def refused() -> None:
            with pytest.raises(ApiError) as error:
                await place(svc, blocked, Policy("public", None), NoLifecycle())
            assert error.value.code == "model_unavailable"
        return refused

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] == 0, counts


async def test_a_capability_nobody_offers_is_named_from_one_session() -> None:
    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)

        async def refused() -> None:
            with pytest.raises(ApiError) as error:
                await place(svc, decision(needs=frozenset({"images"})), Policy("public", None), NoLifecycle())
            assert error.value.code == "model_capability_unsupported"
        return refused

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] <= 1, counts


async def test_a_context_too_long_for_every_session_is_refused_without_reading_one() -> None:
    """The longest context of the sessions a request may use is kept by the views."""
    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)
        counted(fleet(registry, size, models=("short-model",), context_length=2048))
        short = MODEL.model_copy(update={"id": "short-model", "aliases": []})

        def refused() -> None:
            with pytest.raises(ApiError) as error:
                check_context(svc, decision(model=short, context_needed=4096))
            assert error.value.code == "context_length_exceeded"
            check_context(svc, decision(model=short, context_needed=2048))  # fits
        return refused

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] == 0, counts


async def test_the_public_model_list_reads_a_session_per_model() -> None:
    caller = Caller(account_id="acct_consumer", kind="api_key")

    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)

        def listed() -> None:
            assert [entry["id"] for entry in list_models(svc, caller, Policy("public", None))] == [MODEL.id]
        return listed

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] <= 1, counts


async def test_the_owners_model_list_reads_only_the_owners_sessions() -> None:
    def request_for(registry: Registry, size: int) -> Callable[[], Any]:
        svc = services(registry)
        counted(fleet(registry, 3, account=OWNER, machine="mach_owned"))
        caller = Caller(account_id=OWNER, kind="api_key")

        def listed() -> None:
            assert [entry["id"] for entry in list_models(svc, caller, Policy("exclusive", OWNER))] == [MODEL.id]
            assert list(owned_models(svc, OWNER)) == [MODEL.id]
        return listed

    counts = await at_each_size(request_for)
    assert counts[0] == counts[1] == 3, counts


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}")
    await migrate(engine)
    try:
        yield engine
    finally:
        await engine.dispose()


async def _owner_with_machines(engine: AsyncEngine, count: int) -> tuple[str, list[str]]:
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "owner@example.com", "h")
        return account_id, [await machines.create(conn, account_id, name="laptop") for _ in range(count)]


async def test_the_preflight_and_the_machine_list_read_only_the_owners_sessions(engine: AsyncEngine) -> None:
    owner, machine_ids = await _owner_with_machines(engine, 3)
    counts: dict[str, list[int]] = {"preflight": [], "machines": []}
    for size in SIZES:
        registry = Registry()
        crowd(registry, size)
        svc = Services(settings=settings(), engine=engine, registry=registry, rate_limiter=None)  # type: ignore[arg-type]
        for machine_id in machine_ids:  # online, but none can serve privately: the pre-flight names why
            counted(fleet(registry, 1, account=owner, machine=machine_id, runtime_verified=False))
        exclusive = RouteDecision(model=MODEL, owner_account_id=owner, owned_only=True)

        async def preflight() -> None:
            with pytest.raises(ApiError) as error:
                await place(svc, exclusive, Policy("exclusive", owner), NoLifecycle())
            assert error.value.code == "model_routing_blocked"

        async def listing() -> None:
            listed = await linked_machines(svc, owner)
            assert sorted(m["id"] for m in listed if m["online"]) == sorted(machine_ids)

        counts["preflight"].append(await visits(preflight))
        counts["machines"].append(await visits(listing))
    assert counts == {"preflight": [3, 3], "machines": [3, 3]}, counts


def test_the_eviction_check_reads_only_the_sessions_that_may_have_gone_silent() -> None:
    counts = []
    for size in SIZES:
        registry = Registry()
        start = time.monotonic()
        for provider in counted(fleet(registry, size)):
            provider.session.heard(start)
        quiet = SimProvider()
        quiet.session.last_frame_at = start - 100.0
        registry.add(counted([quiet])[0].session)
        _visited.clear()
        assert registry.silent_since(start - 30.0) == [quiet.session]
        counts.append(len(_visited))
    assert counts == [1, 1], counts


def test_the_eviction_check_finds_what_a_pass_over_every_session_finds() -> None:
    rng = random.Random(7)
    registry = Registry()
    sessions: list[ProviderSession] = []
    clock = 1000.0
    for step in range(2000):
        clock += rng.random()
        action = rng.randrange(10)
        if action < 2 or not sessions:
            session = SimProvider().session
            session.last_frame_at = clock - rng.random() * 40
            registry.add(session)
            sessions.append(session)
        elif action < 3:
            registry.remove(sessions.pop(rng.randrange(len(sessions))))
        else:
            rng.choice(sessions).heard(clock)
        deadline = clock - 30.0
        expected = {s for s in sessions if s.last_frame_at < deadline}
        assert set(registry.silent_since(deadline)) == expected, step


def test_the_registry_lets_go_of_the_sessions_it_removed() -> None:
    """The eviction heap keeps a removed session only until its deadline passes, and never a stand-in
    (its last frame is never: its entry would never come up)."""
    registry = Registry()
    now = time.monotonic()
    gone: list[weakref.ref[ProviderSession]] = []
    for _ in range(50):
        local, stand_in = SimProvider().session, SimProvider().session
        local.heard(now - 100.0)
        stand_in.last_frame_at = float("inf")
        registry.add(local)
        registry.add_stand_in(stand_in)
        registry.remove(local)
        registry.remove(stand_in)
        gone += [weakref.ref(local), weakref.ref(stand_in)]
    del local, stand_in
    assert registry.silent_since(now - 30.0) == []  # the removed locals' entries come up and go
    gc.collect()
    assert [ref for ref in gone if ref() is not None] == []
