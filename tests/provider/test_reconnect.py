"""The node's reconnect policy as a pure object: the delays it gives for a sequence of outcomes."""

from __future__ import annotations

import random
import statistics

import pytest

from darkbloom.provider.reconnect import GOING_AWAY, SERVICE_RESTART, TRY_AGAIN_LATER, ReconnectPolicy

NODES = 1000


def fleet(**settings: float) -> list[ReconnectPolicy]:
    return [ReconnectPolicy(rng=random.Random(n), **settings) for n in range(NODES)]  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [SERVICE_RESTART, GOING_AWAY])
def test_a_restart_spreads_a_thousand_nodes_over_the_window(code: int) -> None:
    delays = [policy.delay(registered=True, close_code=code) for policy in fleet(restart_window=10.0)]
    assert all(0 <= d <= 10.0 for d in delays)
    # every tenth of the window gets about a tenth of the fleet: no second where they all arrive
    per_second = [sum(1 for d in delays if s <= d < s + 1) for s in range(10)]
    assert all(60 <= count <= 140 for count in per_second), per_second
    assert len(set(delays)) == NODES


def test_a_lost_session_comes_back_within_the_lost_window() -> None:
    delays = [policy.delay(registered=True, close_code=1006) for policy in fleet(lost_window=1.0)]
    assert all(0 <= d <= 1.0 for d in delays)
    assert 0.4 < statistics.mean(delays) < 0.6


@pytest.mark.parametrize("code", [None, TRY_AGAIN_LATER])
def test_refusals_back_off_exponentially_with_full_jitter_up_to_the_cap(code: int | None) -> None:
    policies = fleet(base=1.0, cap=30.0)
    rounds = [[policy.delay(registered=False, close_code=code) for policy in policies] for _ in range(8)]
    bounds = [1, 2, 4, 8, 16, 30, 30, 30]
    for delays, bound in zip(rounds, bounds):
        assert all(0 <= d <= bound for d in delays)
        assert bound * 0.4 < statistics.mean(delays) < bound * 0.6  # full jitter: uniform over [0, bound]
    assert all(policy.failures == 8 for policy in policies)


def test_a_registration_resets_the_backoff() -> None:
    policy = ReconnectPolicy(rng=random.Random(7), base=1.0, cap=30.0, lost_window=1.0)
    for _ in range(10):
        policy.delay(registered=False, close_code=None)
    assert policy.failures == 10
    assert policy.delay(registered=True, close_code=1006) <= 1.0
    assert policy.failures == 0
    assert policy.delay(registered=False, close_code=None) <= 1.0  # the first refusal again


class Clock:
    """A node's own clock, moved by the simulation."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def restart(up_at: float, window: float = 10.0) -> list[float]:
    """A thousand nodes dropped with 1012 at 0; the new process refuses connections until
    ``up_at``, then registers every node at once. When each registers."""
    registered_at = []
    for n in range(NODES):
        clock = Clock()
        policy = ReconnectPolicy(rng=random.Random(n), clock=clock, restart_window=window)
        clock.now = policy.delay(registered=True, close_code=SERVICE_RESTART)
        while clock.now < up_at:
            clock.now += policy.delay(registered=False, close_code=None)
        registered_at.append(clock.now)
    return registered_at


@pytest.mark.parametrize("up_at", [0.5, 4.0, 9.0])
def test_nodes_refused_during_a_restart_stay_spread_over_its_window(up_at: float) -> None:
    """Refusals while the new process starts move a node to a random moment of what is left of the
    window: the fleet arrives spread over the rest of it (a slow start leaves less of it), none long
    after it."""
    registered_at = restart(up_at)
    assert all(up_at <= t <= 10.0 + 1.0 for t in registered_at)  # past the window: one backoff step at most
    per_second = [sum(1 for t in registered_at if s <= t < s + 1) for s in range(int(max(registered_at)) + 1)]
    assert max(per_second) <= 1.5 * NODES / (10.0 - up_at), per_second  # about uniform over what was left


def test_refusals_after_the_window_back_off_again() -> None:
    clock = Clock()
    policy = ReconnectPolicy(rng=random.Random(3), clock=clock, restart_window=10.0, base=1.0)
    policy.delay(registered=True, close_code=SERVICE_RESTART)
    clock.now = 5.0
    assert policy.delay(registered=False, close_code=None) <= 5.0 and policy.failures == 0
    clock.now = 9.5  # less than `base` left: the ordinary backoff
    bounds = []
    for _ in range(4):
        bounds.append(policy.delay(registered=False, close_code=TRY_AGAIN_LATER))
    assert policy.failures == 4
    assert all(0 <= d <= bound for d, bound in zip(bounds, [1, 2, 4, 8]))
