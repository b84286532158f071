"""A coordinator SIGKILLed under load (64 concurrent clients, streaming and not, capped and uncapped
keys) and restarted on the same database and port: every reservation ends settled or refunded,
nothing is charged twice, every complete answer a client received before the kill was charged
(its settlement committed before the answer's last byte), the reservations the crash left open are
refunded by the restarted process's reconciler, and the books balance to the µUSD."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from tests.support.billing import (check_trails, credit, money_snapshot, new_key, node_home,
                                   open_reservations, read_db, signup, start_serve, wait_registered,
                                   wait_settled, write_catalog)
from tests.support.money import check_ledger_consistency
from tests.support.databases import database_for
from tests.support.processes import Coordinator, start_coordinator, start_fixed_upstream, wait_until

pytestmark = pytest.mark.e2e

MODEL = "fixed-model"
CONCURRENCY = 64
KILL_AFTER = 300       # answers before the SIGKILL
AFTER_RESTART = 200    # answers on the restarted coordinator
STALE_AFTER = 2
CREDIT = 50_000_000


@dataclass
class Answer:
    request_id: str | None
    complete: bool  # a JSON body, or a stream that reached [DONE]


async def load(coord: Coordinator, keys: list[str], answers: int, kill: bool, seed: int) -> list[Answer]:
    """CONCURRENCY clients in a loop until ``answers`` complete answers; then, with ``kill``, SIGKILL
    the coordinator while the others are still in flight and return when every client has seen it."""
    rng = random.Random(seed)
    seen: list[Answer] = []
    enough, stopped = asyncio.Event(), asyncio.Event()

    async def one(client: httpx.AsyncClient) -> Answer:
        stream = rng.random() < 0.5
        body = {"model": MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "user", "content": "load " * rng.randrange(1, 20)}]}
        headers = {"Authorization": f"Bearer {rng.choice(keys)}"}
        url = coord.api_url + "/chat/completions"
        if not stream:
            response = await client.post(url, json=body, headers=headers)
            assert response.status_code == 200, response.text
            return Answer(response.headers.get("x-request-id"), True)
        async with client.stream("POST", url, json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            answer = Answer(response.headers.get("x-request-id"), False)
            async for line in response.aiter_lines():
                answer.complete = answer.complete or line == "data: [DONE]"
            return answer

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not stopped.is_set():
            try:
                seen.append(await one(client))
            except httpx.HTTPError:
                assert kill, "a request failed without a crash"
                return  # the coordinator is gone
            if sum(a.complete for a in seen) >= answers:
                enough.set()

    async def stop() -> None:
        await enough.wait()
        if kill:
            # with the clients still sending: several reservations open in the database (requests past
            # admission, not yet settled), so that the crash has something to leave behind — one alone
            # can settle between the look and the kill on a loaded machine
            await asyncio.to_thread(wait_until, lambda: len(open_reservations(coord.database_url)) >= 8,
                                    timeout=60, interval=0.005, what="reservations open under load")
            coord.process.kill()  # SIGKILL: no shutdown, no draining, no settlement of the rest
        stopped.set()

    # idle connections dropped before uvicorn's 5 s keep-alive timeout closes them: a request sent on one
    # the server is closing at that instant fails with ReadError, which no coordinator fault explains
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await asyncio.gather(stop(), *(client_loop(client) for _ in range(CONCURRENCY)))
    return seen


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_sigkill_under_load_then_restart_settles_or_refunds_everything_once(backend: str, tmp_path: Path) -> None:
    processes = []
    with database_for(backend, tmp_path) as url:
        try:
            upstream, upstream_url = start_fixed_upstream(tmp_path / "upstream", "--delay", "0.02")
            processes.append(upstream)
            catalog = write_catalog(tmp_path / "catalog.json", {"id": MODEL, "input_price": 1_333_333,
                                                                "output_price": 4_666_667, "max_output_tokens": 64})
            args = ("--catalog", str(catalog), "--min-trust", "none", "--instance-stale-after", str(STALE_AFTER))
            coord = start_coordinator(tmp_path / "coordinator", url, *args)
            processes.append(coord.process)
            port = int(coord.base_url.rsplit(":", 1)[1])
            keys, capped = [], []
            for name in ("a", "b"):
                account_id, session = signup(coord)
                assert credit(coord, account_id, CREDIT, f"credit-{name}").status_code == 200
                cap = new_key(coord, session, limit_usd=20, limit_reset="monthly")
                capped.append(cap["id"])
                keys += [cap["key"], new_key(coord, session)["key"]]
            node = start_serve(coord, node_home(tmp_path, "node"), "--backend", "openai", "--upstream-url",
                               upstream_url, "--model", MODEL, "--max-concurrency", str(2 * CONCURRENCY))
            processes.append(node)
            wait_registered(node)

            before = asyncio.run(load(coord, keys, KILL_AFTER, kill=True, seed=1))
            assert coord.process.proc.poll() is not None
            held = {r["request_id"]: r for r in open_reservations(url)}
            assert held, "the kill left no reservation open: nothing was in flight"
            [crashed] = {r["instance_id"] for r in held.values()}
            crash_snapshot = read_db(url, money_snapshot)
            check_trails(crash_snapshot)  # the crash itself left only whole transactions

            restarted = start_coordinator(tmp_path / "coordinator", url, *args, port=port)
            processes.append(restarted.process)
            wait_until(lambda: len(re.findall(r"registered as prov_", node.log())) >= 2, timeout=60,
                       what="the node to reconnect to the restarted coordinator")
            after = asyncio.run(load(restarted, keys, AFTER_RESTART, kill=False, seed=2))
            wait_settled(url, timeout=60)

            snapshot = read_db(url, money_snapshot)
            check_crash(snapshot, held, before + after, capped)
            log = restarted.process.log()
            for request_id, reservation in held.items():
                assert (f"reconciled reservation {request_id} ({reservation['amount_micro_usd']} µUSD) left open "
                        f"by instance {crashed}: refunded") in log
            asyncio.run(_consistent(url))
            print(f"{backend}: SIGKILL after {sum(a.complete for a in before)} answers with {len(held)} reservations "
                  f"open (refunded on restart); {len(snapshot['usage'])} usage rows in all")
        except BaseException:
            for process in processes[1:]:
                print(process.log()[-10_000:])
            raise
        finally:
            for process in reversed(processes):
                process.stop()


def check_crash(snapshot: dict[str, Any], held: dict[str, Any], answers: list[Answer], capped: list[str]) -> None:
    reservations = {r["request_id"]: r for r in snapshot["reservations"]}
    usage = {u["request_id"]: u for u in snapshot["usage"]}
    # every reservation is closed, once; no trail holds anything twice
    assert {r["status"] for r in reservations.values()} <= {"settled", "refunded"}
    check_trails(snapshot)
    # what the crash left open was refunded, not charged: the consumer pays nothing, the provider is not paid
    for request_id in held:
        assert reservations[request_id]["status"] == "refunded" and request_id not in usage
    # a complete answer was charged: its settlement committed before its last byte left
    for answer in answers:
        if answer.complete:
            assert answer.request_id in usage, answer
    # conservation, and each capped key's window holds exactly what its usage rows cost
    total = sum(a["balance_micro_usd"] + a["withdrawable_micro_usd"] for a in snapshot["accounts"])
    assert total == snapshot["credited"] == 2 * CREDIT
    windows = {w["key_id"]: w for w in snapshot["key_spend"]}
    for key_id in capped:
        cost = sum(u["cost_micro_usd"] for u in usage.values() if u["key_id"] == key_id)
        assert (windows[key_id]["spent_micro_usd"], windows[key_id]["reserved_micro_usd"]) == (cost, 0)


async def _consistent(url: str) -> None:
    engine = create_async_engine(url)
    try:
        await check_ledger_consistency(engine)
    finally:
        await engine.dispose()
