"""The coordinator's ledger writer in isolation: no HTTP, no provider, no relay.

`billing.reserve` and `billing.settle_bill` — the two calls a request's lifecycle makes — are
called in-process on a `Services` built as the coordinator builds it, so every step goes through
the process's one ledger writer (group commit: whatever is queued when a batch starts commits in
one transaction), on SQLite (a temp file) and on Postgres (a fresh database `darkbloom_bench_…`,
dropped afterwards), at concurrency 1 and 64:

- reservations/s: key spend cap, conditional balance debit, ledger entry, reservation row;
- settlements/s: on exactly those reservations — refund the hold, charge, key-cap release,
  platform fee, provider payout, usage row.

A step's latency runs from the call to its result (its batch committed). Every concurrent worker
has its own funded account and API key (with a monthly spend cap), so the rows shared by all
settlements are the platform account and the one provider owner receiving every payout — as in
production. Rounds are interleaved across the cells so that a noisy neighbour spreads over all of
them; each cell reports the median rate (and its range) over the rounds, latency percentiles over
all of them, and the mean steps per committed batch. After each round the bench checks that money
is conserved (Σ balances + Σ withdrawable + open reservations = credits).

Run: .venv/bin/python bench/billing.py [--requests 3000] [--rounds 3] [--postgres-dsn DSN]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.money import billing
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts, create_engine, keys, migrate
from darkbloom.store.schema import accounts as accounts_table
from darkbloom.store.schema import reservations
from darkbloom.wire.catalog import BUNDLED_MODEL_ID, CatalogModel
from darkbloom.wire.crypto import token_hash
from darkbloom.wire.protocol import Usage

CONCURRENCIES = (1, 64)
WORKERS = 64             # accounts (and keys), one per concurrent worker
CREDIT = 10_000_000_000  # µUSD per account: never the limiting factor
HOLD = 2_000             # µUSD reserved per request (a short chat with max_tokens ≈ 10,000 here)
USAGE = Usage(prompt_tokens=31, completion_tokens=48)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Bench:
    def __init__(self, services: Services, model: CatalogModel) -> None:
        self.services = services
        self.model = model
        self.callers: list[tuple[str, dict[str, Any]]] = []
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
                                        {"name": f"bench {i}", "limit_micro_usd": CREDIT, "limit_reset": "monthly"})
                self.callers.append((account_id, key))

    async def reserve(self, worker: int) -> billing.Reservation:
        account_id, key = self.callers[worker]
        return await billing.reserve(self.services, "chatcmpl-bench" + secrets.token_hex(10), account_id, key, HOLD)

    async def settle(self, reservation: billing.Reservation) -> None:
        assert self.served is not None
        bill = billing.Bill(reservation.request_id, reservation.account_id, reservation.key_id, self.model,
                            reservation, self_routed=False)
        assert await billing.settle_bill(self.services, bill, USAGE, self.served) is not None

    async def check_conservation(self) -> None:
        """Σ balance + Σ withdrawable + open reservations == credits put in."""
        async with self.services.engine.connect() as conn:
            held = (await conn.execute(select(func.coalesce(
                func.sum(accounts_table.c.balance_micro_usd + accounts_table.c.withdrawable_micro_usd), 0)))).scalar()
            reserved = (await conn.execute(select(func.coalesce(func.sum(reservations.c.amount_micro_usd), 0))
                                           .where(reservations.c.status == "open"))).scalar()
        assert int(held) + int(reserved) == self.credited, (held, reserved, self.credited)


async def run_workers(concurrency: int, total: int,
                      step: Callable[[int], Awaitable[float]]) -> tuple[list[float], float]:
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
class Side:
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    batches: int = 0
    steps: int = 0

    def cells(self) -> str:
        lo, mid, hi = min(self.rates), statistics.median(self.rates), max(self.rates)
        p50, p99 = percentile(self.latencies, 0.5) * 1e3, percentile(self.latencies, 0.99) * 1e3
        return f"{mid:,.0f} ({lo:,.0f}–{hi:,.0f}) | {p50:.2f} | {p99:.2f} | {self.steps / max(self.batches, 1):.1f}"


@dataclass
class Cell:
    reserve: Side = field(default_factory=Side)
    settle: Side = field(default_factory=Side)

    def row(self, label: str, concurrency: int) -> str:
        return f"| {label} | {concurrency} | {self.reserve.cells()} | {self.settle.cells()} |"


async def timed(bench: Bench, side: Side, concurrency: int, total: int, step: Callable[[int], Awaitable[Any]]) -> None:
    writer = bench.services.ledger
    batches, steps = writer.batches, writer.steps

    async def one(index: int) -> float:
        started = time.perf_counter()
        await step(index)
        return time.perf_counter() - started

    latencies, elapsed = await run_workers(concurrency, total, one)
    side.latencies.extend(latencies)
    side.rates.append(total / elapsed)
    side.batches += writer.batches - batches
    side.steps += writer.steps - steps


async def measure(bench: Bench, concurrency: int, total: int, cell: Cell) -> None:
    """One round: ``total`` reservations, then settling exactly those."""
    admitted: list[billing.Reservation] = []

    async def reserve(index: int) -> None:
        admitted.append(await bench.reserve(index))

    async def settle(_index: int) -> None:
        await bench.settle(admitted.pop())

    await timed(bench, cell.reserve, concurrency, total, reserve)
    await timed(bench, cell.settle, concurrency, total, settle)
    assert not admitted
    await bench.check_conservation()


async def open_bench(url: str) -> Bench:
    settings = CoordinatorSettings(database_url=url)
    model = settings.catalog.resolve(BUNDLED_MODEL_ID)
    assert model is not None
    engine = create_engine(url)
    await migrate(engine)
    services = Services(settings=settings, engine=engine, registry=Registry(), rate_limiter=MemoryRateLimiter())
    bench = Bench(services, model)
    await bench.setup(WORKERS)
    for worker in range(16):  # warm-up: connections, prepared statements
        await bench.settle(await bench.reserve(worker))
    return bench


async def _admin(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def main_async(total: int, rounds: int, dsn: str, concurrencies: tuple[int, ...]) -> None:
    print(f"# ledger writer (in-process: no HTTP, no provider) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f" — {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), CPython "
          f"{platform.python_version()}, commit {_commit()}; {rounds} rounds x {total} requests per cell, rounds "
          f"interleaved across cells; usage {USAGE.prompt_tokens}+{USAGE.completion_tokens} tokens on "
          f"{BUNDLED_MODEL_ID}", flush=True)
    name = "darkbloom_bench_" + secrets.token_hex(6)
    base = dsn.split("://", 1)[1].rsplit("/", 1)[0]
    benches: dict[str, Bench] = {}
    await _admin(dsn, f'CREATE DATABASE "{name}"')
    try:
        with tempfile.TemporaryDirectory(prefix="darkbloom-bench-") as tmp:
            benches["SQLite"] = await open_bench(f"sqlite+aiosqlite:///{Path(tmp) / 'billing.db'}")
            benches["Postgres"] = await open_bench(f"postgresql+asyncpg://{base}/{name}")
            cells = {(label, c): Cell() for label in benches for c in concurrencies}
            for _ in range(rounds):
                for (label, concurrency), cell in cells.items():
                    await measure(benches[label], concurrency, total, cell)
            print("| database | conc | reservations/s median (min–max) | reserve p50 ms | reserve p99 ms "
                  "| steps/batch | settlements/s median (min–max) | settle p50 ms | settle p99 ms | steps/batch |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for (label, concurrency), cell in cells.items():
                print(cell.row(label, concurrency))
            for bench in benches.values():
                await bench.services.ledger.close()
                await bench.services.engine.dispose()
    finally:
        await _admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved across the cells")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)),
                        help=f"comma-separated concurrencies (at most {WORKERS})")
    parser.add_argument("--postgres-dsn", default="postgres://postgres@127.0.0.1:5432/postgres",
                        help="maintenance database used to create and drop the bench database")
    args = parser.parse_args()
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    assert all(1 <= c <= WORKERS for c in concurrencies), f"concurrency is 1 to {WORKERS}"
    asyncio.run(main_async(args.requests, args.rounds, args.postgres_dsn, concurrencies))


if __name__ == "__main__":
    main()
