"""Selection time of the scheduler with 10 to 100,000 registered simulated sessions of one model.

Requests through the real code path (`scheduler.try_place`: the request's view of sessions with a
free slot, in expected-wait order → the gates on the sessions reached → claim, which moves the
session within its views):
- public: a request for the model every session serves, so every session is a candidate;
- public, distinct speeds: the same with every session's measured decode speed different (as real
  EWMAs are), so no two sessions share a rank;
- owner-restricted: an exclusive self-route request (`RouteDecision(owner_account_id=…,
  owned_only=True)`) from an account with 2 sessions; its time must not grow with the fleet.

Sessions are in-memory `ProviderSession`s (no sockets) sharing one `Register` frame and one X25519
key, each under its own account, with 4 slots and 0–2 of them busy. Each measured call claims a slot;
the slot is handed back outside the timed region, so every call sees the same fleet. The first
public call opens the model's view (one pass over its sessions); it is reported apart as "first".

Run: .venv/bin/python bench/scheduler.py [--sizes 10,100,1000,10000,100000]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from nacl.public import PrivateKey  # noqa: E402

from darkbloom.wire.catalog import BUNDLED_MODEL_ID, CatalogModel  # noqa: E402
from darkbloom.coordinator.config import CoordinatorSettings  # noqa: E402
from darkbloom.coordinator.fleet.registry import Registry  # noqa: E402
from darkbloom.coordinator.fleet.session import ProviderSession  # noqa: E402
from darkbloom.coordinator.fleet.connection import OutboxLink  # noqa: E402
from darkbloom.coordinator.routing.scheduler import try_place  # noqa: E402
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.wire.crypto import b64e  # noqa: E402
from darkbloom.wire.protocol import ModelInfo, Register  # noqa: E402

MODEL = CatalogModel(id=BUNDLED_MODEL_ID, input_price=50_000, output_price=200_000)
RUNTIME = "sha256:" + "ab" * 32
OWNER = "acct_bench_owner"
CALLS = 5000


def build_fleet(size: int, owned: int = 2, seed: int = 7, distinct_speeds: bool = False) -> Registry:
    rng = random.Random(seed)
    key = PrivateKey.generate().public_key
    register = Register(models=[ModelInfo(id=BUNDLED_MODEL_ID)], public_key=b64e(bytes(key)), runtime_hash=RUNTIME,
                        max_concurrency=4)
    registry = Registry()
    now = time.monotonic()
    for index in range(size):
        account = OWNER if index < owned else f"acct_{index:06d}"
        speed = rng.uniform(5.0, 90.0) if distinct_speeds else rng.choice([0.0, 20.0, 40.0, 80.0])
        session = ProviderSession(id=f"prov_{index:024x}", account_id=account, machine_id=f"mach_{index:024x}",
                                  registration=register, public_key=key, link=OutboxLink(), trust_level="self_signed",
                                  online=True, runtime_verified=True, challenge_passed_at=now, decode_tps=speed)
        registry.add(session)
        for _ in range(rng.randint(0, 2)):
            registry.slots.claim(session)  # busy work already on it
    return registry


def settings() -> CoordinatorSettings:
    return CoordinatorSettings(database_url="sqlite+aiosqlite:///:memory:", min_trust="self_signed",
                               runtime_allow_list=frozenset({RUNTIME}))


def time_selection(registry: Registry, decision: RouteDecision, config: CoordinatorSettings,
                   iterations: int) -> list[float]:
    """Microseconds per `try_place`; each claimed slot is handed back untimed."""
    samples: list[float] = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        placement = try_place(registry, decision, config)
        elapsed = time.perf_counter_ns() - started
        assert placement is not None, "the benchmark fleet always has a free slot"
        placement.slot.release()
        samples.append(elapsed / 1000)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000,10000,100000", help="comma-separated fleet sizes")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    config = settings()
    public = RouteDecision(model=MODEL)
    owner_restricted = RouteDecision(model=MODEL, owner_account_id=OWNER, owned_only=True)
    print(f"# scheduler selection time, {platform.machine()}, {platform.python_implementation()} "
          f"{platform.python_version()}")
    print("| sessions | request | calls | first µs | p50 µs | p99 µs |")
    print("|---|---|---|---|---|---|")
    owner_p50: dict[int, float] = {}
    rows = (("public", public, False), ("public, distinct speeds", public, True),
            ("owner-restricted (2 owned)", owner_restricted, False))
    for size in sizes:
        fleets: dict[bool, Registry] = {}
        for name, decision, distinct in rows:
            if distinct not in fleets:
                fleets[distinct] = build_fleet(size, distinct_speeds=distinct)
            registry = fleets[distinct]
            first = time_selection(registry, decision, config, 1)[0]
            time_selection(registry, decision, config, 20)  # warm-up
            samples = time_selection(registry, decision, config, CALLS)
            if decision is owner_restricted:
                owner_p50[size] = percentile(samples, 0.5)
            print(f"| {size:,} | {name} | {CALLS} | {first:,.1f} | {percentile(samples, 0.5):,.1f} | "
                  f"{percentile(samples, 0.99):,.1f} |", flush=True)
    smallest, largest = min(owner_p50), max(owner_p50)
    ratio = owner_p50[largest] / owner_p50[smallest]
    print(f"\nowner-restricted p50 at {largest:,} vs {smallest:,} sessions: ×{ratio:.2f} "
          f"({'flat' if ratio < 2 else 'GROWS with the fleet'})")


if __name__ == "__main__":
    main()
