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


def test_a_thousand_nodes_refused_after_a_restart_spread_their_retries() -> None:
    """The whole sequence of one restart: dropped with 1012, every first attempt refused (the new
    process is not listening yet), then refused twice more: each round is spread, never a crowd."""
    policies = fleet(restart_window=10.0, base=1.0)
    at = [policy.delay(registered=True, close_code=SERVICE_RESTART) for policy in policies]
    for _ in range(3):
        at = [t + policy.delay(registered=False, close_code=None) for t, policy in zip(at, policies)]
        per_second = [sum(1 for t in at if s <= t < s + 1) for s in range(int(max(at)) + 1)]
        assert max(per_second) < NODES / 8, per_second
