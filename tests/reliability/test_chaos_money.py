"""The chaos money run (issue 12), on SQLite and Postgres.

Over 2,000 requests from 128 concurrent clients go through a real coordinator (its ledger writer
batching every reservation, settlement and refund) to three real provider processes (`openai`
backend in front of bench/fixed_upstream.py): plain, streamed, and abandoned mid-way (a stream
dropped after its first content, a plain request whose client times out), from

- ``public``: a funded account on public routing with an uncapped key;
- ``capped``: a funded account whose key has a small hard cap (some requests: 402 spend_cap_exceeded);
- ``poor``: an account credited a few requests' worth (some requests: 402 insufficient_funds);
- ``prefer``: a funded account that owns provider p1 and sends ``X-Darkbloom-Route: prefer`` (free and
  refunded while p1 serves it; paid on the public fleet once p1 is gone);
- ``exclusive``/``exclusive-key``: an account with no money that owns provider p3, by header
  (``X-Darkbloom-Route: self``) and by a ``self_route_only`` key (always free, never reserved)

(tests/support/chaos.py makes them, and the plan of requests, for the run across replicas too).

Mid-run p1 is SIGKILLed; later the coordinator is SIGKILLed and restarted on the same database and
port (``--instance-stale-after`` short, so the restarted process refunds what the dead one left
open), and the run continues until at least 2,000 requests were sent. Afterwards, straight from the
database: conservation to the µUSD, nothing negative, no cap exceeded, one usage row per completed
request and none for a refused one, no reservation open, every exclusive row free, every request's
ledger trail legal (nothing charged twice). A summary line of the outcomes is printed; the test fails
if a category it relies on never happened.

Reuses the machinery of tests/coordinator/money/test_conservation.py (the request driver and its
outcome record) and test_crash_under_load.py (kill, restart on the same port, reconciliation).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from darkbloom.store.schema import PLATFORM_ACCOUNT_ID

from tests.support.billing import (billing_coordinator, check_trails, money_snapshot, node_home,
                                   open_reservations, read_db, start_serve, wait_registered, wait_settled,
                                   write_catalog)
from tests.support.money import check_ledger_consistency
from tests.coordinator.money.test_conservation import (FEE_BPS, INPUT_PRICE, MODEL, OUTPUT_PRICE, Outcome,
                                                       Spender, one_request)
from tests.support.accounts import device_token
from tests.support.chaos import chaos_accounts, chaos_plan, route_clients
from tests.support.databases import database_for
from tests.support.processes import Coordinator, Process, start_coordinator, start_fixed_upstream, wait_until

pytestmark = pytest.mark.e2e

CONCURRENCY = 128
REQUESTS = 2_100          # planned; at least MIN_SENT of them must reach a coordinator
MIN_SENT = 2_000
NODE_KILL_AT = 350        # finished requests before p1 (the prefer account's machine) is SIGKILLed
COORD_KILL_AT = 1_000     # finished requests before the coordinator is SIGKILLed
STALE_AFTER = 2           # --instance-stale-after: the restarted process reconciles the dead one quickly


@dataclass
class ChaosOutcome(Outcome):
    phase: int = 1
    lost: bool = False     # the coordinator died under it (connection reset mid-request)
    unsent: bool = False   # never reached a coordinator (connection refused while it was down)


async def chaos_request(clients: dict[str, httpx.AsyncClient], base: str, spender: Spender, rng: random.Random,
                        outcome: ChaosOutcome) -> None:
    """test_conservation's request driver, on the client that carries this spender's route header;
    a dead coordinator is an outcome here, not an error."""
    try:
        await one_request(clients[spender.name], base, spender, rng, outcome)
    except httpx.ConnectError:
        outcome.unsent = True
    except httpx.HTTPError:
        outcome.lost = True


async def run_phase(coord: Coordinator, clients: dict[str, httpx.AsyncClient], spenders: dict[str, Spender],
                    plan: list[tuple[Spender, ChaosOutcome]], phase: int, rng: random.Random, kill_node: tuple[int, Process] | None = None,
                    kill_coordinator_at: int | None = None) -> list[ChaosOutcome]:
    """CONCURRENCY clients take the next planned request until the plan is used up; with
    ``kill_node`` (at, node) that node is SIGKILLed once ``at`` requests finished; with
    ``kill_coordinator_at`` the coordinator is SIGKILLed once that many finished, and the phase ends
    when every client has seen it. Returns the outcomes of the requests tried."""
    tried: list[ChaosOutcome] = []
    finished = 0
    coordinator_dead = False

    async def worker() -> None:
        nonlocal finished, coordinator_dead
        while plan and not coordinator_dead:
            spender, outcome = plan.pop()
            outcome.phase = phase
            tried.append(outcome)
            await chaos_request(clients, coord.api_url, spender, rng, outcome)
            finished += 1
            if kill_node is not None and finished >= kill_node[0] and kill_node[1].proc.poll() is None:
                kill_node[1].kill()
            if kill_coordinator_at is not None and finished >= kill_coordinator_at and not coordinator_dead:
                coordinator_dead = True
                coord.process.kill()  # SIGKILL: no shutdown, no draining, no settlement of the rest

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    for outcome in tried:  # never sent: back into the plan, for the next phase
        if outcome.unsent:
            plan.append((spenders[outcome.spender], ChaosOutcome(outcome.spender, outcome.stream, outcome.walk_away)))
    return tried


async def drive(coord: Coordinator, spenders: dict[str, Spender], plan: list[tuple[Spender, ChaosOutcome]], phase: int, seed: int,
                **kills: Any) -> list[ChaosOutcome]:
    clients = route_clients(spenders)
    try:
        return await run_phase(coord, clients, spenders, plan, phase, random.Random(seed), **kills)
    finally:
        for client in clients.values():
            await client.aclose()


def registrations(node: Process) -> list[str]:
    return re.findall(r"registered as (prov_\w+)", node.log())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_chaos_money_run(backend: str, tmp_path: Path) -> None:
    started = time.monotonic()
    rng = random.Random("chaos-" + backend)
    processes: list[Process] = []
    with database_for(backend, tmp_path) as url:
        coord: Coordinator | None = None
        try:
            upstream, upstream_url = start_fixed_upstream(tmp_path / "upstream", "--delay", "0.02")
            processes.append(upstream)
            catalog = write_catalog(tmp_path / "catalog.json", {"id": MODEL, "input_price": INPUT_PRICE,
                                                                "output_price": OUTPUT_PRICE,
                                                                "max_output_tokens": 64})
            coord = billing_coordinator(tmp_path / "coordinator", url, catalog, "--platform-fee-bps", str(FEE_BPS),
                                        "--cancel-grace", "2", "--first-content-timeout", "60",
                                        "--queue-depth", str(4 * CONCURRENCY), "--queue-max-wait", "60",
                                        "--instance-stale-after", str(STALE_AFTER))
            processes.append(coord.process)
            port = int(coord.base_url.rsplit(":", 1)[1])
            made = chaos_accounts([coord])
            by_name, credited = made.spenders, made.credited
            spenders = list(by_name.values())

            # p1: the prefer account's machine (SIGKILLed mid-run); p2: unowned; p3: the exclusive account's
            nodes: dict[str, Process] = {}
            owner_account = {"p1": made.accounts["prefer"], "p2": None, "p3": made.accounts["exclusive"]}
            owner_of_node = {name: account.account_id if account else None for name, account in owner_account.items()}
            for name, account in owner_account.items():
                token = device_token(coord, account) if account else None
                node = start_serve(coord, node_home(tmp_path, name, token), "--backend", "openai", "--upstream-url",
                                   upstream_url, "--model", MODEL, "--max-concurrency", str(CONCURRENCY))
                processes.append(node)
                nodes[name] = node
            for node in nodes.values():
                wait_registered(node)

            plan = chaos_plan(rng, spenders, REQUESTS, ChaosOutcome)

            # phase 1: p1 dies mid-run, then the coordinator
            before = asyncio.run(drive(coord, by_name, plan, 1, rng.randrange(2**32), kill_node=(NODE_KILL_AT, nodes["p1"]),
                                       kill_coordinator_at=COORD_KILL_AT))
            assert nodes["p1"].proc.poll() is not None and coord.process.proc.poll() is not None
            held = {r["request_id"]: r for r in open_reservations(url)}
            crashed_instances = {r["instance_id"] for r in held.values()}
            check_trails(read_db(url, money_snapshot))  # the crash itself left only whole transactions

            # phase 2: the same coordinator command on the same database and port; the survivors reconnect
            coord = start_coordinator(tmp_path / "coordinator", url, *coord.extra_args, port=port)
            processes.append(coord.process)
            for name in ("p2", "p3"):
                wait_until(lambda: len(registrations(nodes[name])) >= 2, timeout=60,
                           what=f"{name} to reconnect to the restarted coordinator")
            after = asyncio.run(drive(coord, by_name, plan, 2, rng.randrange(2**32)))
            assert not plan, f"{len(plan)} planned requests never sent"
            wait_settled(url, timeout=120)

            snapshot = read_db(url, money_snapshot)
            owners = {provider_id: owner_of_node[name] for name, node in nodes.items()
                      for provider_id in registrations(node)}
            outcomes = [o for o in before + after if not o.unsent]
            summary = check_chaos(snapshot, outcomes, spenders, credited, owners, held,
                                  exclusive_providers=set(registrations(nodes["p3"])),
                                  prefer_providers=set(registrations(nodes["p1"])))
            log = coord.process.log()
            for request_id, reservation in held.items():
                assert (f"reconciled reservation {request_id} ({reservation['amount_micro_usd']} µUSD) left open "
                        f"by instance {reservation['instance_id']}: refunded") in log, request_id
            assert len(crashed_instances) <= 1, crashed_instances
            asyncio.run(_consistent(url))
            print(f"{backend} chaos money run ({time.monotonic() - started:.0f} s): {summary}")
        except BaseException:
            if coord is not None:
                print(coord.process.log()[-20_000:])
            raise
        finally:
            for process in reversed(processes):
                process.stop()


def check_chaos(snapshot: dict[str, Any], outcomes: list[ChaosOutcome], spenders: list[Spender], credited: int,
                owners: dict[str, str | None], held: dict[str, Any], exclusive_providers: set[str],
                prefer_providers: set[str], *, min_sent: int = MIN_SENT, concurrency: int = CONCURRENCY) -> str:
    by_name = {s.name: s for s in spenders}
    accounts = {a["id"]: a for a in snapshot["accounts"]}
    reservations = {r["request_id"]: r for r in snapshot["reservations"]}
    usage = {u["request_id"]: u for u in snapshot["usage"]}
    exclusive_account = by_name["exclusive"].account_id
    prefer_account = by_name["prefer"].account_id

    # the outcome tally (printed, and in every failure message)
    def kind(o: ChaosOutcome) -> str:
        if o.lost:
            return "lost-in-crash"
        if o.done:
            return "done-stream" if o.stream else "done-plain"
        if o.disconnected:
            return "abandoned-stream" if o.stream else "abandoned-plain"
        if o.error_event:
            return "stream-error-event"
        return f"{o.status} {o.error_type}" if o.status != 200 else "200 incomplete"
    tally = Counter(kind(o) for o in outcomes)
    prefer_rows = [u for u in usage.values() if u["account_id"] == prefer_account]
    exclusive_rows = [u for u in usage.values() if u["account_id"] == exclusive_account]
    prefer_free = [u for u in prefer_rows if u["provider_id"] in prefer_providers]
    prefer_paid = [u for u in prefer_rows if u["provider_id"] not in prefer_providers]
    summary = (f"{len(outcomes)} sent at c={concurrency} ({sum(o.phase == 2 for o in outcomes)} after the restart): "
               f"{dict(sorted(tally.items()))}; reservations {dict(Counter(r['status'] for r in reservations.values()))}"
               f", {len(held)} open at the crash; usage rows {len(usage)} (prefer free {len(prefer_free)}, prefer "
               f"paid {len(prefer_paid)}, exclusive {len(exclusive_rows)})")

    # 1. conservation to the µUSD; nothing negative
    assert snapshot["credited"] == credited, summary
    assert sum(a["balance_micro_usd"] + a["withdrawable_micro_usd"] for a in accounts.values()) == credited, summary
    assert all(a["balance_micro_usd"] >= 0 and a["withdrawable_micro_usd"] >= 0 for a in accounts.values()), summary

    # 2. no reservation open; a reservation is settled exactly when its request has a usage row;
    #    what the crash left open was refunded, not charged
    assert {r["status"] for r in reservations.values()} <= {"settled", "refunded"}, summary
    assert {rid for rid, r in reservations.items() if r["status"] == "settled"} == \
        {rid for rid, u in usage.items() if u["account_id"] != exclusive_account}, summary
    for request_id in held:
        assert reservations[request_id]["status"] == "refunded" and request_id not in usage, (request_id, summary)

    # 3. one usage row per completed request, none for a refused one (and a 402 reserved nothing)
    assert len(usage) == len(snapshot["usage"]), summary
    for o in outcomes:
        if o.done:
            assert o.request_id in usage, (o, summary)
            row = usage[o.request_id]
            assert row["account_id"] == by_name[o.spender].account_id, (o, row)
            assert row["key_id"] == by_name[o.spender].key_id, (o, row)
        elif o.status is not None and o.status != 200:
            assert o.request_id is None or (o.request_id not in usage and
                                            (o.status != 402 or o.request_id not in reservations)), (o, summary)
    known = {o.request_id for o in outcomes if o.request_id is not None}
    # only a 402 is sure to leave no row: a 502 after admission (every provider failed) has a refunded
    # reservation
    refused = sum(o.status == 402 for o in outcomes)
    assert len(set(usage) | set(reservations)) <= len(outcomes) - refused, summary
    # a usage row nobody saw the end of is a walk-away settled for its reported tokens, or an answer whose
    # settlement committed just before the coordinator died, or a stream cut by the crash after settling
    unseen = [rid for rid in usage if rid not in known]
    assert len(unseen) <= sum(o.lost or o.request_id is None for o in outcomes), (unseen, summary)

    # 4. exclusive: never reserved, never charged, only ever on its own machine; prefer: free exactly
    #    when its own machine served
    for row in usage.values():
        if row["key_id"] in (by_name["exclusive"].key_id, by_name["exclusive-key"].key_id):
            assert row["request_id"] not in reservations, row
            assert (row["cost_micro_usd"], row["platform_fee_micro_usd"], row["provider_payout_micro_usd"]) == (0, 0, 0), row
            assert row["self_routed"] and row["routed"] == "owned" and not row["ownership_changed"], row
            assert row["provider_id"] in exclusive_providers, row
    for row in prefer_free:
        assert row["cost_micro_usd"] == 0 and row["self_routed"] and row["routed"] == "owned", row
        assert reservations[row["request_id"]]["status"] == "settled", row
    for row in prefer_paid:
        assert row["cost_micro_usd"] > 0 and not row["self_routed"] and row["routed"] == "fleet", row

    # 5. the ledger: each request's trail legal (nothing charged or refunded twice), exclusive requests
    #    leave no entries, the pockets are what the usage rows say
    check_trails(snapshot)
    trails = Counter(e["request_id"] for e in snapshot["ledger"] if e["request_id"] is not None)
    for row in usage.values():
        if row["key_id"] in (by_name["exclusive"].key_id, by_name["exclusive-key"].key_id):
            assert trails[row["request_id"]] == 0, row
    charges = Counter(e["request_id"] for e in snapshot["ledger"] if e["kind"] == "charge")
    assert not [rid for rid, n in charges.items() if n > 1], summary
    credits: Counter[str] = Counter()
    for entry in snapshot["ledger"]:
        if entry["kind"] == "admin_credit":
            credits[entry["account_id"]] += entry["amount_micro_usd"]
    spent: Counter[str] = Counter()
    earned: Counter[str] = Counter()
    for row in usage.values():
        spent[row["account_id"]] += row["cost_micro_usd"]
        assert row["platform_fee_micro_usd"] == row["cost_micro_usd"] * FEE_BPS // 10_000, row
        assert row["provider_payout_micro_usd"] == row["cost_micro_usd"] - row["platform_fee_micro_usd"], row
        assert row["provider_account_id"] == owners[row["provider_id"]], row
        earned[row["provider_account_id"] or PLATFORM_ACCOUNT_ID] += row["provider_payout_micro_usd"]
        earned[PLATFORM_ACCOUNT_ID] += row["platform_fee_micro_usd"]
    for account_id, row in accounts.items():
        assert row["balance_micro_usd"] == credits[account_id] - spent[account_id], (account_id, summary)
        assert row["withdrawable_micro_usd"] == earned[account_id], (account_id, summary)

    # 6. hard caps: the capped key's settled spend within its cap, nothing left reserved
    windows = {w["key_id"]: w for w in snapshot["key_spend"]}
    for spender in spenders:
        if spender.cap is None:
            continue
        key_cost = sum(u["cost_micro_usd"] for u in usage.values() if u["key_id"] == spender.key_id)
        assert key_cost <= spender.cap, (spender, key_cost)
        assert (windows[spender.key_id]["spent_micro_usd"], windows[spender.key_id]["reserved_micro_usd"]) == \
            (key_cost, 0), spender

    # 7. no internal error, and every path the assertions rely on actually ran
    assert not [o for o in outcomes if o.status == 500 or (o.error_type or "").startswith("not an")], summary
    assert len(outcomes) >= min_sent, summary
    errors = Counter(o.error_type for o in outcomes)
    required = {
        "402 spend_cap_exceeded": errors["spend_cap_exceeded"],
        "402 insufficient_funds": errors["insufficient_funds"],
        "done plain": sum(o.done and not o.stream for o in outcomes),
        "done stream": sum(o.done and o.stream for o in outcomes),
        "abandoned stream": sum(o.disconnected and o.stream for o in outcomes),
        "abandoned plain": sum(o.disconnected and not o.stream for o in outcomes),
        "lost in the coordinator crash": sum(o.lost for o in outcomes),
        # (how many reservations are open at the instant of the kill varies from 0 to ~100 with the
        # timing; "lost in the coordinator crash" above is what proves the crash hit requests in flight)
        "done after the restart": sum(o.done and o.phase == 2 for o in outcomes),
        "prefer served free by its machine": len(prefer_free),
        "prefer paid on the fleet": len(prefer_paid),
        "exclusive by header": sum(u["key_id"] == by_name["exclusive"].key_id for u in usage.values()),
        "exclusive by self_route_only key": sum(u["key_id"] == by_name["exclusive-key"].key_id for u in usage.values()),
        "refunded reservations": sum(r["status"] == "refunded" for r in reservations.values()),
    }
    empty = [name for name, count in required.items() if not count]
    assert not empty, f"never happened: {empty}; {summary}"
    return summary


async def _consistent(url: str) -> None:
    engine = create_async_engine(url)
    try:
        await check_ledger_consistency(engine)
    finally:
        await engine.dispose()
