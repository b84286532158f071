"""Paid requests' ledger work alone, on Postgres: K coordinators' ledger writers (each its own engine)
take reservations and settle them against one fresh database, c requests at a time per writer, N
paying accounts taking turns and each writer's payouts going to an owner of its own. Prints, per
cell, paid requests per second and what each costs: this process's CPU (the writers' client side),
the database backends' CPU (read from /proc), ledger batches, the share of them planned on known rows
(the write alone), and those done again under locks because their write found a row changed.

Where replicas' CPU per request goes to the ledger (bench/replicas.py), this measures a change to the
ledger without the HTTP stacks around it. Runs the working tree's ``src/`` or another (``--src DIR``,
e.g. a ``git archive`` of an older commit); run the two alternately to compare.

Run: .venv/bin/python bench/ledger_writers.py [--writers 1,3] [--concurrency 1,8] [--accounts 1,8]
     [--seconds 4] [--src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet_probes import cpu_seconds  # noqa: E402  (no darkbloom import: --src still chooses it)
from tests.support.metrics import sample  # noqa: E402


def _planned(plan: str) -> float:
    """Ledger batches so far by what they were planned on (0 on a ``src/`` from before that metric)."""
    return sample("darkbloom_ledger_batches_total", plan=plan)


async def _cell(url: str, writers: int, concurrency: int, accounts: int, seconds: float) -> dict[str, Any]:
    from sqlalchemy import text

    from darkbloom.coordinator.config import CoordinatorSettings
    from darkbloom.coordinator.fleet.registry import Registry
    from darkbloom.coordinator.money import billing
    from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
    from darkbloom.coordinator.services import Services
    from darkbloom.store import accounts as account_store
    from darkbloom.store import create_engine
    from darkbloom.wire.catalog import CatalogModel
    from darkbloom.wire.protocol import Usage

    model = CatalogModel(id="bench-model", input_price=1_333_333, output_price=4_666_667, max_output_tokens=256)
    usage = Usage(prompt_tokens=20, completion_tokens=16)
    coordinators = []
    for _ in range(writers):
        engine = create_engine(url)
        coordinators.append(Services(settings=CoordinatorSettings(database_url=url), engine=engine,
                                     registry=Registry(), rate_limiter=MemoryRateLimiter()))
    async with coordinators[0].engine.begin() as conn:
        payers = []
        for _ in range(accounts):
            payer = await account_store.create_account(conn, f"payer-{secrets.token_hex(5)}@example.com", "x")
            await account_store.credit(conn, payer, 10**15, "ref-" + secrets.token_hex(6))
            payers.append(payer)
        owners = [await account_store.create_account(conn, f"owner-{secrets.token_hex(5)}@example.com", "x")
                  for _ in range(writers)]
    turns = itertools.cycle(payers)
    done = 0

    async def requests(services: Services, owner: str, deadline: float) -> None:
        nonlocal done
        served = billing.Served(provider_id="prov_bench", provider_account_id=owner)
        while time.monotonic() < deadline:
            request_id = "req-" + secrets.token_hex(8)
            held = await billing.reserve(services, request_id, next(turns), None, 50_000)
            bill = billing.Bill(request_id, held.account_id, None, model, held, self_routed=False)
            await billing.settle_bill(services, bill, usage, served)
            done += 1

    async def run(duration: float) -> None:
        deadline = time.monotonic() + duration
        await asyncio.gather(*(requests(services, owner, deadline) for services, owner in zip(coordinators, owners)
                               for _ in range(concurrency)))

    await run(1.0)  # warm up: connections, prepared statements
    async with coordinators[0].engine.connect() as conn:
        pids = list((await conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ))).scalars())
    batches0, steps0 = sum(s.ledger.batches for s in coordinators), sum(s.ledger.steps for s in coordinators)
    known0, locked0 = _planned("known"), _planned("locked")
    done, server0, client0, wall0 = 0, sum(map(cpu_seconds, pids)), time.process_time(), time.monotonic()
    await run(seconds)
    wall, client = time.monotonic() - wall0, time.process_time() - client0
    server = sum(map(cpu_seconds, pids)) - server0
    batches = sum(s.ledger.batches for s in coordinators) - batches0
    known, locked = _planned("known") - known0, _planned("locked") - locked0
    for services in coordinators:
        await services.ledger.close()
        await services.engine.dispose()
    return {"req/s": done / wall, "client µs/req": client / done * 1e6, "server µs/req": server / done * 1e6,
            "batches/req": batches / done, "steps/batch": (sum(s.ledger.steps for s in coordinators) - steps0)
            / max(batches, 1), "known %": 100 * known / max(batches, 1), "locked %": 100 * locked / max(batches, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", default="1,3")
    parser.add_argument("--concurrency", default="1,8", help="requests at a time per writer")
    parser.add_argument("--accounts", default="1,8")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--src", type=Path, default=ROOT / "src")
    args = parser.parse_args()
    sys.path.insert(0, str(args.src))
    import uvloop

    from darkbloom.store import create_engine, migrate
    from tests.support.databases import postgres_database

    print(f"src: {args.src}", flush=True)
    print("| writers | c per writer | paying accounts | paid req/s | client CPU µs/req | server CPU µs/req "
          "| batches/req | steps/batch | on known rows % | again under locks % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for writers, concurrency, accounts in itertools.product(
            *(map(int, value.split(",")) for value in (args.writers, args.concurrency, args.accounts))):
        with postgres_database() as url:
            async def cell() -> dict[str, Any]:
                engine = create_engine(url)
                await migrate(engine)
                await engine.dispose()
                return await _cell(url, writers, concurrency, accounts, args.seconds)

            row = uvloop.run(cell())
        print(f"| {writers} | {concurrency} | {accounts} | {row['req/s']:.0f} | {row['client µs/req']:.0f} "
              f"| {row['server µs/req']:.0f} | {row['batches/req']:.2f} | {row['steps/batch']:.2f} "
              f"| {row['known %']:.0f} | {row['locked %']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
