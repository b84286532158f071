"""Selection from the registry's views: the same answer as a full survey, through every change a
session can go through (slots claimed and released, speed measured, trust lost or gained, draining,
disowned, disconnected, newly registered), and the survey only when nothing is eligible."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from typing import Any, Callable

import pytest
from prometheus_client import REGISTRY

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.routing import queue as queueing
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.queue import NoEligibleSession, RequestQueues
from darkbloom.coordinator.routing.gates import passes_lasting_gates
from darkbloom.coordinator.routing.scheduler import (any_eligible, candidates, expected_wait, longest_context,
                                                     routable_public, select, select_idle_or_free, survey,
                                                     try_place)
from tests.coordinator.routing.sim import BAD_HASH, GOOD_HASH, MODEL, SimProvider, decision, fleet, settings

OWNER = "acct_owner"
OTHER = "acct_other"
PINNED = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, weight_hash=GOOD_HASH)


def _rejections(reason: str) -> float:
    return REGISTRY.get_sample_value("darkbloom_scheduler_rejections_total", {"reason": reason}) or 0.0


# the reference: what the scheduler chose before it had views (a full survey, then the rule)


def best_by_survey(registry: Registry, route: RouteDecision, config: Any) -> set[ProviderSession]:
    """Every session ``choose`` could return from a full survey (all the equally good ones)."""
    available = survey(registry, route, config).available
    owned = [s for s in available if route.owns(s)]
    pool = owned or ([] if route.owned_only else available)
    if not pool:
        return set()
    best = min(expected_wait(s, route.names) for s in pool)
    return {s for s in pool if expected_wait(s, route.names) == best}


def best_for_retry(registry: Registry, route: RouteDecision, config: Any, idle_only: bool) -> set[ProviderSession]:
    """The retry and backup rule: idle if asked, owned first, the model loaded, fewest active, then fastest."""
    available = [s for s in survey(registry, route, config).available if not idle_only or s.active == 0]
    owned = [s for s in available if route.owns(s)]
    pool = owned or ([] if route.owned_only else available)
    if not pool:
        return set()

    def rank(s: ProviderSession) -> tuple[bool, int, float]:
        return not s.has_loaded(route.names), s.active, -s.decode_tps

    best = min(rank(s) for s in pool)
    return {s for s in pool if rank(s) == best}


def longest_by_survey(registry: Registry, route: RouteDecision, config: Any) -> float:
    """The longest context of the sessions that pass every lasting gate for the route (0 unknown = inf)."""
    sessions = [s for s in candidates(registry, route) if passes_lasting_gates(s, route, config)]
    return max((s.context_for(route.names) or math.inf for s in sessions), default=0)


class World:
    """A registry of varied simulated sessions and a random walk through what happens to them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.registry = Registry()
        self.held: dict[ProviderSession, list[Slot]] = {}
        self.machines = 0
        for _ in range(24):
            self.add()

    def add(self) -> None:
        rng = self.rng
        self.machines += 1
        provider = SimProvider(
            models=rng.choice([(MODEL.id,), ("smollm2",), (MODEL.id, "smollm2"), ("other-model",)]),
            account=rng.choice([None, None, OWNER, OTHER]), machine=f"mach_{self.machines}",
            trust=rng.choice(["none", "self_signed", "self_signed", "hardware"]),
            max_concurrency=rng.choice([1, 2, 3, 4]), private_only=rng.random() < 0.15,
            vision=rng.random() < 0.5, weight_hash=rng.choice(["", GOOD_HASH, BAD_HASH]),
            runtime_verified=rng.random() < 0.9, challenge_age=rng.choice([0.0, 0.0, 0.0, None, 5000.0]),
            decode_tps=rng.choice([0.0, 20.0, 40.0]), online=rng.random() < 0.95,
            context_length=rng.choice([0, 512, 2048, 2048, 8192]),
            loaded=rng.choice([None, (), (MODEL.id,), ("smollm2",)]))
        self.registry.add(provider.session)
        self.held[provider.session] = []

    def step(self) -> None:
        rng = self.rng
        sessions = list(self.held)
        session = rng.choice(sessions)
        action = rng.randrange(12)
        if action < 4 and session.has_free_slot:
            self.held[session].append(self.registry.slots.claim(session))
        elif action < 7 and self.held[session]:
            self.held[session].pop(rng.randrange(len(self.held[session]))).release()
        elif action == 7:
            if rng.random() < 0.5:
                session.report_speed(rng.choice([0.0, 20.0, 40.0, 80.0, 33.3]))
            else:  # a heartbeat that lists the models loaded now
                session.report_loaded(rng.choice([[], [MODEL.id], ["smollm2"], [MODEL.id, "other-model"]]))
        elif action == 8:
            change: Callable[[], None] = rng.choice([
                lambda: session.distrust("failed a challenge"),
                session.start_draining,
                session.mark_online,
                lambda: session.raise_trust("hardware"),
                lambda: session.record_challenge_pass(rng.choice([None, time.monotonic(), 1.0]))])
            change()
        elif action == 9:
            session.disown()
        elif action == 10 and len(sessions) > 4:
            self.registry.remove(session)
            for slot in self.held.pop(session):
                slot.release()
        else:
            self.add()


ROUTES = [
    ("public", decision(), {}),
    ("images", decision(needs=frozenset({"images"})), {}),
    ("weights pinned", decision(model=PINNED), {}),
    ("hardware floor", decision(), {"min_trust": "hardware"}),
    ("prefer", decision(owner_account_id=OWNER), {}),
    ("prefer, images", decision(owner_account_id=OWNER, needs=frozenset({"images"})), {}),
    ("exclusive", decision(owner_account_id=OWNER, owned_only=True), {}),
    ("exclusive, pinned", decision(owner_account_id=OWNER, owned_only=True, pinned="mach_3"), {}),
    ("prefer, weights pinned", decision(model=PINNED, owner_account_id=OWNER), {}),
    ("exclusive, weights pinned", decision(model=PINNED, owner_account_id=OWNER, owned_only=True), {}),
    ("long context", decision(context_needed=2049), {}),
    ("prefer, long context", decision(owner_account_id=OWNER, context_needed=600), {}),
]


@pytest.mark.parametrize("seed", range(4))
def test_selection_matches_a_full_survey_through_every_change(seed: int) -> None:
    world = World(random.Random(seed))
    configs = {name: settings(**fields) for name, _, fields in ROUTES}
    configs["public, excluded"] = settings()
    for step in range(200):
        world.step()
        excluded = {s.id for s in world.rng.sample(list(world.held), 2)}
        for name, route, _ in ROUTES + [("public, excluded", decision(excluded=excluded), {})]:
            config = configs[name]
            registry = world.registry
            expected = best_by_survey(registry, route, config)
            got = select(registry, route, config)
            assert (got in expected) if expected else got is None, (step, name)
            assert any_eligible(registry, route, config) == bool(survey(registry, route, config).eligible), (step, name)
            for idle in (False, True):
                expected = best_for_retry(registry, route, config, idle)
                got = select_idle_or_free(registry, route, config, idle)
                assert (got in expected) if expected else got is None, (step, name, idle)
            assert longest_context(registry, route, config) == longest_by_survey(registry, route, config), (step, name)
        public = bool(survey(world.registry, decision(), configs["public"]).eligible)
        assert routable_public(world.registry, MODEL, configs["public"]) == public


def test_equally_good_sessions_share_the_load_at_random() -> None:
    random.seed(99)
    registry = Registry()
    tied = fleet(registry, 20, decode_tps=40.0)
    ruled_out = {p.id for p in tied[:15]}  # a big rank where most draws fail: still uniform over the rest
    route = decision(excluded=ruled_out)
    picks: Counter[str] = Counter()
    for _ in range(500):
        placement = try_place(registry, route, settings())
        assert placement is not None
        picks[placement.session.id] += 1
        placement.slot.release()
    assert set(picks) == {p.id for p in tied[15:]}
    assert min(picks.values()) > 50  # 100 each expected


def test_load_then_speed_then_random() -> None:
    registry = Registry()
    slow, fast = fleet(registry, 1, max_concurrency=4, decode_tps=10.0) + fleet(registry, 1, max_concurrency=4,
                                                                                decode_tps=90.0)
    unmeasured, = fleet(registry, 1, max_concurrency=8)
    order = []
    for _ in range(6):
        placement = try_place(registry, decision(), settings())
        assert placement is not None
        order.append((placement.session, placement.session.active))
    # 1/8 (unmeasured, idle, big) first; then 2/8 = 1/4 ties unmeasured@1 with fast@0 and slow@0: fast wins
    assert order[0][0] is unmeasured.session and order[1][0] is fast.session
    assert {s for s, _ in order} == {slow.session, fast.session, unmeasured.session}


def test_a_speed_measured_later_reorders_the_view() -> None:
    registry = Registry()
    a, b = fleet(registry, 2, max_concurrency=2)
    placement = try_place(registry, decision(), settings())  # opens the view
    assert placement is not None
    placement.slot.release()
    a.session.report_speed(5.0)
    b.session.report_speed(50.0)
    assert select(registry, decision(), settings()) is b.session


def test_disowned_draining_untrusted_and_removed_sessions_leave_the_views() -> None:
    registry = Registry()
    owned, = fleet(registry, 1, account=OWNER, machine="mach_owned")
    exclusive = decision(owner_account_id=OWNER, owned_only=True)
    assert select(registry, exclusive, settings()) is owned.session
    owned.session.disown()
    assert select(registry, exclusive, settings()) is None
    assert select(registry, decision(), settings()) is owned.session  # still public fleet
    owned.session.start_draining()
    assert select(registry, decision(), settings()) is None
    other, = fleet(registry, 1)
    assert select(registry, decision(), settings()) is other.session
    other.session.distrust("a chunk that does not open")
    assert select(registry, decision(), settings()) is None
    newcomer, = fleet(registry, 1)
    registry.remove(newcomer.session)
    assert select(registry, decision(), settings()) is None and not routable_public(registry, MODEL, settings())


def test_a_session_that_comes_online_joins() -> None:
    registry = Registry()
    late = SimProvider(online=False)
    registry.add(late.session)
    assert select(registry, decision(), settings()) is None
    late.session.mark_online()
    assert select(registry, decision(), settings()) is late.session


def test_an_accounts_views_go_with_its_last_session() -> None:
    registry = Registry()
    owned, = fleet(registry, 1, account=OWNER)
    exclusive = decision(owner_account_id=OWNER, owned_only=True)
    assert select(registry, exclusive, settings()) is owned.session
    assert any(view.account_id == OWNER for view in registry._views.values())
    registry.remove(owned.session)
    assert not any(view.account_id == OWNER for view in registry._views.values())
    for name in ("mystery-1", "mystery-2"):  # names nobody serves leave nothing behind
        assert select(registry, decision(model=CatalogModel(id=name, input_price=0, output_price=0),
                                         owner_account_id=OWNER, owned_only=True), settings()) is None
    assert not any(view.account_id == OWNER for view in registry._views.values())


def test_only_examined_sessions_are_counted() -> None:
    registry = Registry()
    fleet(registry, 50, runtime_verified=False)  # never in the view: never examined
    fleet(registry, 1, challenge_age=None)       # in the view (the clock may change it): examined
    good, = fleet(registry, 1, max_concurrency=2, active=1)
    before = {reason: _rejections(reason) for reason in ("runtime_not_verified", "challenge_stale")}
    placement = try_place(registry, decision(), settings())
    assert placement is not None and placement.session is good.session
    assert _rejections("runtime_not_verified") == before["runtime_not_verified"]
    assert _rejections("challenge_stale") in (before["challenge_stale"], before["challenge_stale"] + 1)


async def test_the_survey_runs_only_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[RouteDecision] = []
    real_survey = queueing.survey

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return real_survey(*args, **kwargs)

    monkeypatch.setattr(queueing, "survey", counted)
    registry = Registry()
    provider, = fleet(registry, 1, max_concurrency=2)
    q = RequestQueues(registry, settings())
    placement = await q.place(decision())
    assert placement.session is provider.session and calls == []
    with pytest.raises(NoEligibleSession) as refused:
        await q.place(decision(model=CatalogModel(id="nobody-serves-this", input_price=1, output_price=1)))
    assert calls == []  # refused from the views: no survey on the request path
    assert refused.value.survey.eligible == [] and len(calls) == 1  # made when read (the Self-Route pre-flight)
