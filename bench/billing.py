"""The coordinator's billing path in isolation: no HTTP, no provider, no relay.

`billing` and `admission` are called in-process on a `Services` built as the coordinator builds
it (in-memory rate limiter), on SQLite (a temp file) and on Postgres (a fresh database
`darkbloom_bench_…`, dropped afterwards), at concurrency 1 and 64:

- admission latency: `admission.admit_request_rate` + `admission.admit` per request — RPM, ITPM
  and OTPM on the API key's buckets, the prompt/output bounds, and the reservation (key spend cap,
  conditional balance debit, ledger entry, reservation row: one transaction). This is what billing
  adds to a request before it is dispatched.
- settlements/s: `billing.settle` on exactly those reservations — refund, charge, key-cap release,
  platform fee, provider payout, usage row: one transaction each.

Every concurrent worker has its own funded account and API key (rpm/itpm/otpm limits far above
the load, plus a monthly spend cap), so the rows shared by all settlements are the platform account
and the one provider owner receiving every payout — as in production. Rounds are interleaved
across the four cells so that a noisy neighbour spreads over all of them; each cell reports the
median rate (and its range) and latency percentiles over all rounds. After each round the bench
checks that money is conserved (Σ balances + Σ withdrawable + open reservations = credits).

Run: .venv/bin/python bench/billing.py [--requests 300] [--rounds 3] [--postgres-dsn DSN]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from darkbloom.wire.catalog import BUNDLED_MODEL_ID, CatalogModel
from darkbloom.coordinator.money import admission
from darkbloom.coordinator.money import billing
from darkbloom.coordinator.http.auth import Caller
from darkbloom.coordinator.inference.chat_request import ChatRequest, parse_chat_request
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import token_hash
from darkbloom.wire.protocol import Usage
from darkbloom.store import accounts, create_engine, keys, migrate
from darkbloom.store.schema import accounts as accounts_table
from darkbloom.store.schema import reservations

CONCURRENCIES = (1, 64)
CREDIT = 10_000_000_000  # µUSD per account: never the limiting factor
HIGH = 1_000_000_000     # per-minute limits that never trip
BODY = {"model": BUNDLED_MODEL_ID, "max_tokens": 64,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Write one sentence about the sea."}]}
USAGE = Usage(prompt_tokens=31, completion_tokens=48)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Bench:
    def __init__(self, services: Services, model: CatalogModel, chat: ChatRequest) -> None:
        self.services = services
        self.model = model
        self.chat = chat
        self.callers: list[Caller] = []
        self.served: billing.Served | None = None
        self.credited = 0

    async def setup(self, workers: int) -> None:
        async with self.services.engine.begin() as conn:
            owner = await accounts.create_account(conn, "provider-owner@bench.invalid", None)
            self.served = billing.Served(provider_id="prov_bench", provider_account_id=owner)
            for i in range(workers):
                account_id = await accounts.create_account(conn, f"user{i}@bench.invalid", None)
                await accounts.credit(conn, account_id, CREDIT, f"bench-credit-{account_id}")
                self.credited += CREDIT
                key = await keys.create(conn, account_id, token_hash(secrets.token_hex(16)), "dk-bench",
                                        {"name": f"bench {i}", "limit_micro_usd": CREDIT, "limit_reset": "monthly",
                                         "rpm_limit": HIGH, "itpm_limit": HIGH, "otpm_limit": HIGH})
                self.callers.append(Caller(account_id=account_id, kind="api_key", key=key))

    async def settle(self, reservation: billing.Reservation) -> None:
        assert self.served is not None
        result = await billing.settle(self.services, reservation, self.model, USAGE, self.served)
        assert result is not None

    async def admit(self, caller: Caller) -> billing.Reservation:
        taken = await admission.admit_request_rate(self.services, caller)
        taken = await admission.admit(self.services, caller, self.chat, self.model, new_request_id(), taken)
        assert taken.reservation is not None
        return taken.reservation

    async def check_conservation(self) -> None:
        """Σ balance + Σ withdrawable + open reservations == credits put in."""
        async with self.services.engine.connect() as conn:
            held = (await conn.execute(select(func.coalesce(
                func.sum(accounts_table.c.balance_micro_usd + accounts_table.c.withdrawable_micro_usd), 0)))).scalar()
            reserved = (await conn.execute(select(func.coalesce(func.sum(reservations.c.amount_micro_usd), 0))
                                           .where(reservations.c.status == "open"))).scalar()
        assert int(held) + int(reserved) == self.credited, (held, reserved, self.credited)


def new_request_id() -> str:
    return "chatcmpl-bench" + secrets.token_hex(10)


async def run_workers(concurrency: int, total: int, step: Callable[[int], Awaitable[float]]) -> tuple[list[float], float]:
    """``concurrency`` workers share ``total`` steps; worker i passes i to each of its steps."""
    latencies: list[float] = []
    remaining = total

    async def worker(index: int) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            latencies.append(await step(index))

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, time.perf_counter() - started


@dataclass
class Cell:
    settle_rates: list[float] = field(default_factory=list)
    admit_rates: list[float] = field(default_factory=list)
    admit_latencies: list[float] = field(default_factory=list)

    def row(self, label: str, concurrency: int) -> str:
        lo, mid, hi = min(self.settle_rates), statistics.median(self.settle_rates), max(self.settle_rates)
        p50, p99 = percentile(self.admit_latencies, 0.5) * 1e3, percentile(self.admit_latencies, 0.99) * 1e3
        return (f"| {label} | {concurrency} | {mid:.0f} ({lo:.0f}–{hi:.0f}) | {p50:.1f} | {p99:.1f} "
                f"| {statistics.median(self.admit_rates):.0f} |")


async def measure(bench: Bench, concurrency: int, total: int, cell: Cell) -> None:
    """One round: ``total`` admissions (timed each), then settling exactly those reservations."""
    callers = bench.callers
    admitted: list[billing.Reservation] = []

    async def admit_one(index: int) -> float:
        started = time.perf_counter()
        reservation = await bench.admit(callers[index])
        took = time.perf_counter() - started
        admitted.append(reservation)
        return took

    latencies, elapsed = await run_workers(concurrency, total, admit_one)
    cell.admit_latencies.extend(latencies)
    cell.admit_rates.append(total / elapsed)

    async def settle_one(index: int) -> float:
        started = time.perf_counter()
        await bench.settle(admitted.pop())
        return time.perf_counter() - started

    _, elapsed = await run_workers(concurrency, total, settle_one)
    assert not admitted
    cell.settle_rates.append(total / elapsed)
    await bench.check_conservation()


async def open_bench(url: str) -> Bench:
    settings = CoordinatorSettings(database_url=url)
    model = settings.catalog.resolve(BUNDLED_MODEL_ID)
    assert model is not None
    engine = create_engine(url)
    await migrate(engine)
    services = Services(settings=settings, engine=engine, registry=Registry(), rate_limiter=MemoryRateLimiter())
    bench = Bench(services, model, parse_chat_request(json.dumps(BODY).encode()))
    await bench.setup(max(CONCURRENCIES))
    for caller in bench.callers[:16]:  # warm-up: pool connections, statement caches
        await bench.settle(await bench.admit(caller))
    return bench


async def _admin(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def main_async(total: int, rounds: int, dsn: str) -> None:
    model = CoordinatorSettings().catalog.resolve(BUNDLED_MODEL_ID)
    assert model is not None
    print(f"# billing path (in-process: no HTTP, no provider) — {time.strftime('%Y-%m-%d')} — {platform.node()} "
          f"({platform.machine()}, {os.cpu_count()} cores); {rounds} rounds x {total} requests per cell, "
          f"rounds interleaved across cells; model {BUNDLED_MODEL_ID} ({model.input_price}/{model.output_price} "
          f"µUSD per 1M), usage {USAGE.prompt_tokens}+{USAGE.completion_tokens} tokens", flush=True)
    name = "darkbloom_bench_" + secrets.token_hex(6)
    base = dsn.split("://", 1)[1].rsplit("/", 1)[0]
    benches: dict[str, Bench] = {}
    await _admin(dsn, f'CREATE DATABASE "{name}"')
    try:
        with tempfile.TemporaryDirectory(prefix="darkbloom-bench-") as tmp:
            benches["SQLite"] = await open_bench(f"sqlite+aiosqlite:///{Path(tmp) / 'billing.db'}")
            benches["Postgres"] = await open_bench(f"postgresql+asyncpg://{base}/{name}")
            cells = {(label, c): Cell() for label in benches for c in CONCURRENCIES}
            for _ in range(rounds):
                for (label, concurrency), cell in cells.items():
                    await measure(benches[label], concurrency, total, cell)
            print("| database | conc | settlements/s median (min–max) | admission p50 ms | admission p99 ms "
                  "| admissions/s |")
            print("|---|---|---|---|---|---|")
            for (label, concurrency), cell in cells.items():
                print(cell.row(label, concurrency))
            for bench in benches.values():
                await bench.services.engine.dispose()
    finally:
        await _admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across the cells")
    parser.add_argument("--postgres-dsn", default="postgres://postgres@127.0.0.1:5432/postgres",
                        help="maintenance database used to create and drop the bench database")
    args = parser.parse_args()
    asyncio.run(main_async(args.requests, args.rounds, args.postgres_dsn))


if __name__ == "__main__":
    main()
