"""The chaos money run across three coordinator replicas (issue 14's conservation acceptance).

Three real replicas of one coordinator (one Postgres database, one Redis, the machine's NATS under a
subject prefix of the run's own) and four real provider processes (`openai` backend in front of
bench/fixed_upstream.py), connected to different replicas:

- ``p1`` (the prefer account's machine) on replica 0 — SIGKILLed mid-run;
- ``p2`` (unowned) on replica 1;
- ``p3`` (the exclusive account's machine) and ``p4`` (unowned) on replica 2, through a TCP proxy that
  stands for the load balancer's URL.

Every request goes to a replica picked at random, so most are served across the NATS hop, by the
same spenders as tests/reliability/test_chaos_money.py (public, capped key, poor, prefer, exclusive by
header and by a ``self_route_only`` key) and the same request driver (plain, streamed, abandoned).
Mid-run, once the database shows reservations of its own open (requests in flight on it), replica 2
is SIGKILLed: the load balancer (the clients here, and the proxy of its nodes) sends everything to
the survivors from then on; p3 and p4 reconnect through the proxy to replica 1. Requests replica 2
admitted die with it (connection reset); requests the survivors admitted and its nodes served fail
over before first content or end with the error event after it. The reservations replica 2 left open are refunded by the survivors'
reconciliation (``--instance-stale-after``: a dead instance's reservations once its heartbeat is that
old). Afterwards, from the database, exactly the single-replica run's invariants
(``test_chaos_money.check_chaos``): conservation to the µUSD, nothing negative, no reservation open,
one usage row per completed request and its cost equal to its ledger trail, no cap exceeded, exclusive
always free, prefer free exactly on its own machine; plus: everything the dead replica held open was
refunded by a survivor (one log line each, naming the dead instance), no live replica's reservation
was ever reconciled, every replica admitted requests served through another's node and every
replica's nodes served requests another admitted, and both survivors still serve, public and
exclusive (on p3 reconnected). ``check_chaos`` is the single-replica run's own, given this run's size floor and concurrency.

"Phase 2" in the shared summary means after the replica was killed ("after the restart" there).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

import tests.reliability.test_chaos_money as chaos
from tests.support.billing import (check_trails, money_snapshot, node_home, open_reservations, read_db,
                                   wait_registered, wait_settled, write_catalog)
from tests.coordinator.money.test_conservation import FEE_BPS, INPUT_PRICE, MODEL, OUTPUT_PRICE, Spender
from tests.support.accounts import device_token
from tests.support.chaos import chaos_accounts, chaos_plan, route_clients
from tests.support.processes import Coordinator, Process, darkbloom_cmd, spawn, start_fixed_upstream, wait_until
from tests.support.replicas import Replicas, TcpProxy, replica_set

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

CONCURRENCY = 128
REQUESTS = 2_000         # planned; a request refused at the connection (a dead replica) is sent again
NODE_KILL_AT = 350       # finished requests before p1 (the prefer account's machine) is SIGKILLed
REPLICA_KILL_AT = 900    # finished requests before replica 2 is SIGKILLed (once it holds OPEN_AT_KILL open)
OPEN_AT_KILL = 5         # reservations of replica 2's own open when it is killed, at least
# a dead replica's reservations are refunded once its heartbeat is this old; live replicas heartbeat
# every max(1, this / 3) s, so this leaves a loaded live replica seconds of slack before it would be
# taken for dead (which the log check below would catch)
STALE_AFTER = 6


@dataclass
class ReplicaOutcome(chaos.ChaosOutcome):
    replica: int = -1   # which replica the request was sent to


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def drive(coords: list[Coordinator], replicas: Replicas, doomed: int, doomed_instance: str, proxy: TcpProxy,
                spenders: dict[str, Spender], plan: list[tuple[Spender, ReplicaOutcome]], seed: int,
                kill_node: Process) -> tuple[list[ReplicaOutcome], dict[str, dict[str, Any]]]:
    """CONCURRENCY clients take the next planned request and send it to a random live replica; p1 is
    SIGKILLed after NODE_KILL_AT finished; replica ``doomed`` after REPLICA_KILL_AT finished, as soon
    as the database shows at least OPEN_AT_KILL reservations of its own open (a thread watches: the
    event loop is too busy to look in time); from then on the clients and the proxy only use the
    survivors. A request refused at the connection is planned again. Returns the outcomes and the
    reservations the dead replica left open, read right after the kill."""
    rng = random.Random(seed)
    clients = route_clients(spenders)
    tried: list[ReplicaOutcome] = []
    held: dict[str, dict[str, Any]] = {}
    state = {"finished": 0, "dead": False}
    stop = threading.Event()

    def own_open() -> list[dict[str, Any]]:
        return [r for r in open_reservations(replicas.database_url) if r["instance_id"] == doomed_instance]

    def killer() -> None:
        deadline: float | None = None
        while not stop.is_set():
            if state["finished"] >= REPLICA_KILL_AT:
                deadline = deadline or time.monotonic() + 30
                if len(own_open()) >= OPEN_AT_KILL or time.monotonic() > deadline:
                    state["dead"] = True  # the load balancer takes it out, and it dies
                    replicas.kill(coords[doomed])  # SIGKILL: no goodbye on NATS, no settlement of the rest
                    proxy.retarget(port_of(coords[1].base_url))  # its nodes' next connection goes to replica 1
                    held.update({r["request_id"]: r for r in own_open()})  # survivors reconcile them seconds later
                    return
            time.sleep(0.05)

    async def worker() -> None:
        while plan:
            spender, outcome = plan.pop()
            live = [i for i in range(len(coords)) if not (state["dead"] and i == doomed)]
            outcome.replica = rng.choice(live)
            outcome.phase = 2 if state["dead"] else 1
            tried.append(outcome)
            await chaos.chaos_request(clients, coords[outcome.replica].api_url, spender, rng, outcome)
            if outcome.unsent:  # never reached a replica: the load balancer tries again elsewhere
                plan.append((spender, ReplicaOutcome(outcome.spender, outcome.stream, outcome.walk_away)))
                continue
            state["finished"] += 1
            if state["finished"] >= NODE_KILL_AT and kill_node.proc.poll() is None:
                kill_node.kill()

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        stop.set()
        watcher.join(30)
        for client in clients.values():
            await client.aclose()
    assert state["dead"], "replica 2 was never killed"
    return tried, held


async def _snapshot_rr(url: str) -> dict[str, Any]:
    """money_snapshot in one REPEATABLE READ transaction: a consistent picture while survivors write."""
    engine = create_async_engine(url, isolation_level="REPEATABLE READ")
    try:
        async with engine.connect() as conn:
            return await money_snapshot(conn)
    finally:
        await engine.dispose()


def reconciled(log: str) -> list[tuple[str, int, str]]:
    """(request id, amount, instance) of every reservation this replica's reconciliation refunded."""
    return [(rid, int(amount), instance) for rid, amount, instance in
            re.findall(r"reconciled reservation (\S+) \((\d+) µUSD\) left open by instance (\S+): refunded", log)]


def online(coord: Coordinator, session: str, provider_ids: set[str]) -> bool:
    response = httpx.get(coord.api_url + "/me/providers", headers={"Authorization": f"Bearer {session}"}, timeout=10)
    return any(m["online"] and m["session_id"] in provider_ids for m in response.json()["data"])


@pytest.mark.timeout(400)
def test_chaos_money_across_three_replicas(tmp_path: Path) -> None:
    started = time.monotonic()
    rng = random.Random("chaos-replicas")
    processes: list[Process] = []
    proxy: TcpProxy | None = None
    catalog = write_catalog(tmp_path / "catalog.json", {"id": MODEL, "input_price": INPUT_PRICE,
                                                        "output_price": OUTPUT_PRICE, "max_output_tokens": 64})
    args = ("--catalog", str(catalog), "--min-trust", "none", "--platform-fee-bps", str(FEE_BPS),
            "--cancel-grace", "2", "--first-content-timeout", "60", "--queue-depth", str(4 * CONCURRENCY),
            "--queue-max-wait", "60", "--instance-stale-after", str(STALE_AFTER))
    with replica_set(tmp_path / "replicas", 3, *args) as replicas:
        coords = replicas.coordinators
        url = replicas.database_url
        try:
            upstream, upstream_url = start_fixed_upstream(tmp_path / "upstream", "--delay", "0.02")
            processes.append(upstream)
            made = chaos_accounts(coords)  # through the replicas in turn: one database behind all of them
            by_name, credited = made.spenders, made.credited
            spenders = list(by_name.values())
            prefer, exclusive = made.accounts["prefer"], made.accounts["exclusive"]

            # p1 on replica 0, p2 on replica 1, p3 and p4 on replica 2 through the "load balancer"
            proxy = TcpProxy(port_of(coords[2].base_url))
            nodes: dict[str, Process] = {}
            owner_account = {"p1": prefer, "p2": None, "p3": exclusive, "p4": None}
            owner_of_node = {name: account.account_id if account else None for name, account in owner_account.items()}
            for name, target in [("p1", coords[0].base_url), ("p2", coords[1].base_url), ("p3", proxy.url),
                                 ("p4", proxy.url)]:
                account = owner_account[name]
                token = device_token(coords[1], account) if account else None
                node = spawn(darkbloom_cmd("serve", "--coordinator", target, "--backend", "openai", "--upstream-url",
                                           upstream_url, "--model", MODEL, "--max-concurrency", str(CONCURRENCY)),
                             node_home(tmp_path, name, token), "node.log")
                processes.append(node)
                nodes[name] = node
            first_ids = {name: wait_registered(node) for name, node in nodes.items()}
            # every replica sees the whole fleet before the run (the model listed through each of them)
            for coord in coords:
                for name, session in (("p1", prefer.session), ("p3", exclusive.session)):
                    wait_until(lambda: online(coord, session, {first_ids[name]}), timeout=30,
                               what=f"{name} online through {coord.base_url}")

            # one request per replica first: each replica serves, and its reservations carry its instance id
            warmups = [ReplicaOutcome("public", False, False, replica=i) for i in range(3)]

            async def warm() -> None:
                async with httpx.AsyncClient() as client:
                    for outcome in warmups:
                        await chaos.one_request(client, coords[outcome.replica].api_url, by_name["public"], rng,
                                                outcome)
            asyncio.run(warm())
            assert all(o.done for o in warmups), warmups
            wait_settled(url, timeout=30)
            reservation_of = {r["request_id"]: r for r in read_db(url, money_snapshot)["reservations"]}
            instance = [reservation_of[o.request_id]["instance_id"] for o in warmups]
            assert len(set(instance)) == 3, instance

            plan = chaos_plan(rng, spenders, REQUESTS, ReplicaOutcome)

            outcomes, held = asyncio.run(drive(coords, replicas, 2, instance[2], proxy, by_name, plan,
                                               rng.randrange(2**32), nodes["p1"]))
            assert not plan, f"{len(plan)} planned requests never sent"
            assert nodes["p1"].proc.poll() is not None and coords[2].process.proc.poll() is not None
            check_trails(asyncio.run(_snapshot_rr(url)))  # mid-reconciliation: only whole transactions

            # p3 and p4 reconnect through the proxy to replica 1; both survivors still serve, public and exclusive
            for name in ("p3", "p4"):
                wait_until(lambda: len(chaos.registrations(nodes[name])) >= 2, timeout=60,
                           what=f"{name} to reconnect to a surviving replica")
            again = set(chaos.registrations(nodes["p3"])[1:])
            for coord in coords[:2]:
                wait_until(lambda: online(coord, exclusive.session, again), timeout=30,
                           what=f"p3 online again through {coord.base_url}")
            finals = [ReplicaOutcome(name, stream, False, phase=2, replica=i)
                      for i in (0, 1) for name in ("public", "exclusive-key") for stream in (False, True)]

            async def last() -> None:
                async with httpx.AsyncClient() as client:
                    for outcome in finals:
                        await chaos.one_request(client, coords[outcome.replica].api_url, by_name[outcome.spender],
                                                rng, outcome)
            asyncio.run(last())
            assert all(o.done for o in finals), finals

            wait_settled(url, timeout=90)  # the dead replica's reservations: refunded by a survivor
            snapshot = read_db(url, money_snapshot)
            owners = {provider_id: owner_of_node[name] for name, node in nodes.items()
                      for provider_id in chaos.registrations(node)}
            everything = warmups + [o for o in outcomes if not o.unsent] + finals
            # the single-replica run's checks (its size floor and concurrency are this run's)
            summary = chaos.check_chaos(snapshot, everything, spenders, credited, owners, held,
                                        exclusive_providers=set(chaos.registrations(nodes["p3"])),
                                        prefer_providers=set(chaos.registrations(nodes["p1"])),
                                        min_sent=REQUESTS, concurrency=CONCURRENCY)

            # the dead replica's open reservations were refunded by the survivors' reconciliation, once
            # each; nothing a live replica held was ever taken for abandoned
            assert held, f"replica 2 left no reservation open; {summary}"
            def lines() -> list[tuple[str, int, str]]:
                return [entry for coord in coords[:2] for entry in reconciled(coord.process.log())]
            # (the log line follows the refund's commit by a moment)
            with contextlib.suppress(AssertionError):
                wait_until(lambda: len(lines()) >= len(held), timeout=10, what="the reconciliation log lines")
            assert Counter(rid for rid, _, _ in lines()) == Counter(list(held)), (sorted(held), lines())
            for rid, amount, by in lines():
                assert by == instance[2] and amount == held[rid]["amount_micro_usd"], (rid, amount, by)
            asyncio.run(chaos._consistent(url))

            # the run was a cross-replica one: every replica admitted requests served by a node another
            # replica held, and the nodes of every replica served requests another replica admitted
            holder = {first_ids["p1"]: 0, first_ids["p2"]: 1}
            for name in ("p3", "p4"):
                first, *later = chaos.registrations(nodes[name])
                holder[first] = 2
                holder.update({provider_id: 1 for provider_id in later})  # the proxy led to replica 1
            usage = {u["request_id"]: u for u in snapshot["usage"]}
            for outcome in finals:  # the survivors served on p3 as reconnected, exclusive from either of them
                if outcome.spender == "exclusive-key":
                    assert usage[outcome.request_id]["provider_id"] in again, (outcome, usage[outcome.request_id])
            paths = Counter((o.replica, holder[usage[o.request_id]["provider_id"]]) for o in everything
                            if o.done and o.request_id in usage)
            for replica in range(3):
                assert sum(n for (a, h), n in paths.items() if a == replica and h != replica), (replica, paths)
                assert sum(n for (a, h), n in paths.items() if h == replica and a != replica), (replica, paths)
            per_replica = Counter((o.replica, o.phase) for o in everything)
            print(f"chaos money run across 3 replicas ({time.monotonic() - started:.0f} s): {summary}; "
                  f"sent per (replica, phase) {dict(sorted(per_replica.items()))}; completed per (admitting, "
                  f"holding replica) {dict(sorted(paths.items()))}; {len(held)} open on the dead replica, "
                  f"refunded by the survivors' reconciliation")
        except BaseException:
            for i, coord in enumerate(coords):
                print(f"--- replica {i} ---\n{coord.process.log()[-8_000:]}")
            raise
        finally:
            for process in reversed(processes):
                process.stop()
            if proxy is not None:
                proxy.close()
