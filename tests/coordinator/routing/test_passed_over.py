"""Machine insight's passed_over: what the public views' tallies count for each machine that advertised
the model, one reason per request it did not get, without a pass over the fleet per request."""

from __future__ import annotations

from collections import Counter

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.scheduler import try_place
from tests.coordinator.routing.sim import BAD_HASH, GOOD_HASH, MODEL, decision, fleet, settings

PINNED = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, weight_hash=GOOD_HASH)
TOOLS = ("tools",)


def _machine(registry: Registry, name: str, **fields: object) -> None:
    fields.setdefault("weight_hash", GOOD_HASH)
    fields.setdefault("capabilities", TOOLS)
    fleet(registry, 1, machine=f"mach_{name}", account=f"acct_{name}", **fields)


def test_each_machine_is_passed_over_for_its_reason() -> None:
    registry = Registry()
    config = settings()
    _machine(registry, "chosen", max_concurrency=100, decode_tps=50.0)
    _machine(registry, "busy", active=1, decode_tps=90.0)
    _machine(registry, "untrusted_floor", trust="none")
    _machine(registry, "private", private_only=True)
    _machine(registry, "weights", weight_hash=BAD_HASH)
    _machine(registry, "runtime", runtime_verified=False)
    _machine(registry, "stale", max_concurrency=1000, decode_tps=99.0, challenge_age=10_000.0)
    _machine(registry, "slow", capabilities=(), max_concurrency=1, decode_tps=1.0)

    served = Counter()
    for needs in [frozenset()] * 5 + [frozenset(TOOLS)] * 3:
        claim = try_place(registry, decision(model=PINNED, needs=needs), config)
        assert claim is not None
        served[claim.session.machine_id] += 1
    assert served == {"mach_chosen": 8}

    registry.settle_tallies()
    counts = registry.passed_over.take()
    assert {(m, r): n for (m, r), n in counts.items() if n} == {
        ("mach_busy", "busy"): 8,
        ("mach_untrusted_floor", "trust_floor"): 8,
        ("mach_private", "private_only"): 8,
        ("mach_weights", "unverified_weights"): 8,
        ("mach_runtime", "runtime_unverified"): 8,
        ("mach_stale", "challenge_stale"): 8,
        ("mach_slow", "another_machine_chosen"): 5,
        ("mach_slow", "capability"): 3,
    }


def test_a_request_counts_once_and_not_for_the_owner_s_exclusive_routes() -> None:
    registry = Registry()
    config = settings()
    _machine(registry, "a", max_concurrency=1)
    _machine(registry, "b", max_concurrency=1)
    first = try_place(registry, decision(model=PINNED), config)
    assert first is not None
    other = "mach_b" if first.session.machine_id == "mach_a" else "mach_a"
    route = decision(model=PINNED)
    assert try_place(registry, route, config) is not None  # the other one; both are busy now
    assert try_place(registry, route, config) is None      # the same request again (a retry): not counted
    assert try_place(registry, decision(model=PINNED, owner_account_id="acct_x", owned_only=True), config) is None
    registry.settle_tallies()
    counts = registry.passed_over.take()
    assert counts[(other, "another_machine_chosen")] == 1
    assert counts[(first.session.machine_id, "busy")] == 1
    assert sum(counts.values()) == 2
