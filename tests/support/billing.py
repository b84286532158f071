"""Real processes for the billing end-to-end tests: coordinators with a priced catalog, provider
nodes (the bundled model, or the `openai` backend in front of bench/fixed_upstream.py), and direct
reads of the coordinator's database."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from darkbloom.store.schema import (accounts, admin_credits, key_spend, ledger_entries, reservations,
                                    usage_records)

from tests.support.processes import Coordinator, Process, darkbloom_cmd, spawn, start_coordinator, wait_until


def write_catalog(path: Path, *models: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"models": list(models)}))
    return path


def billing_coordinator(home: Path, database_url: str, catalog: Path, *extra: str) -> Coordinator:
    """A coordinator that routes to any node (no trust floor) with the given catalog."""
    return start_coordinator(home, database_url, "--catalog", str(catalog), "--min-trust", "none", *extra)


def node_home(root: Path, name: str, token: str | None = None) -> Path:
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    if token is not None:
        path = home / "auth_token"
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
    return home


def start_serve(coord: Coordinator, home: Path, *args: str) -> Process:
    return spawn(darkbloom_cmd("serve", "--coordinator", coord.base_url, *args), home, "node.log")


def wait_registered(node: Process, timeout: float = 90) -> str:
    """The node's provider session id, once the coordinator has confirmed its registration."""
    def registered() -> str | None:
        if node.proc.poll() is not None:
            raise AssertionError(f"node exited:\n{node.log()}")
        match = re.search(r"registered as (prov_\w+)", node.log())
        return match.group(1) if match else None
    return str(wait_until(registered, timeout=timeout, interval=0.1, what="node registration"))


def credit(coord: Coordinator, account_id: str, amount: int, reference: str | None = None) -> httpx.Response:
    return httpx.post(coord.api_url + "/admin/credit", headers=coord.admin(), json={
        "account_id": account_id, "amount_micro_usd": amount, "reference": reference or secrets.token_hex(8)})


def signup(coord: Coordinator) -> tuple[str, str]:
    """A new account: (account_id, session token)."""
    response = httpx.post(coord.api_url + "/auth/signup", json={
        "email": f"b-{secrets.token_hex(5)}@example.com", "password": "correct horse 1"})
    response.raise_for_status()
    body = response.json()
    return body["account_id"], body["token"]


def new_key(coord: Coordinator, session: str, **fields: Any) -> dict[str, Any]:
    response = httpx.post(coord.api_url + "/keys", json={"name": "billing", **fields},
                          headers={"Authorization": f"Bearer {session}"})
    assert response.status_code == 201, response.text
    return dict(response.json())


# the coordinator's database, read directly

async def _read(database_url: str, work: Any) -> Any:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            return await work(conn)
    finally:
        await engine.dispose()


def read_db(database_url: str, work: Any) -> Any:
    """Run ``await work(conn)`` on a fresh connection (from sync code)."""
    return asyncio.run(_read(database_url, work))


def table(database_url: str, tbl: Any, *where: Any) -> list[dict[str, Any]]:
    async def work(conn: Any) -> list[dict[str, Any]]:
        query = select(tbl)
        for clause in where:
            query = query.where(clause)
        return [dict(r) for r in (await conn.execute(query)).mappings()]
    return list(read_db(database_url, work))


def pockets(database_url: str, account_id: str) -> tuple[int, int]:
    [row] = table(database_url, accounts, accounts.c.id == account_id)
    return int(row["balance_micro_usd"]), int(row["withdrawable_micro_usd"])


def open_reservations(database_url: str) -> list[dict[str, Any]]:
    return table(database_url, reservations, reservations.c.status == "open")


def wait_settled(database_url: str, timeout: float = 30, request_ids: list[str] | None = None) -> None:
    """Until no reservation (or none of these) is open."""
    def done() -> bool:
        still = open_reservations(database_url)
        if request_ids is not None:
            still = [r for r in still if r["request_id"] in request_ids]
        return not still
    wait_until(done, timeout=timeout, interval=0.2, what="open reservations to close")


async def money_snapshot(conn: Any) -> dict[str, Any]:
    async def all_rows(tbl: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in (await conn.execute(select(tbl))).mappings()]
    credited = int((await conn.execute(select(func.coalesce(func.sum(admin_credits.c.amount_micro_usd), 0))))
                   .scalar() or 0)
    return {"accounts": await all_rows(accounts), "ledger": await all_rows(ledger_entries),
            "reservations": await all_rows(reservations), "usage": await all_rows(usage_records),
            "key_spend": await all_rows(key_spend), "credited": credited}


def wait_log(process: Process, pattern: str, timeout: float = 30) -> re.Match[str]:
    return wait_until(lambda: re.search(pattern, process.log()), timeout=timeout, interval=0.1,
                      what=f"log line {pattern!r}")



def check_trails(snapshot: dict[str, Any]) -> None:
    """Every request's ledger entries form one legal trail, so nothing was charged (or refunded) twice:
    ``reservation`` then ``refund`` for a refunded one; ``reservation``, ``refund`` and at most one
    ``charge`` / ``platform_fee`` / ``payout`` matching its usage row for a settled one; just the
    ``reservation`` while open; and without a reservation (exclusive self-route) only what its usage row says."""
    reservations = {r["request_id"]: r for r in snapshot["reservations"]}
    usage = {u["request_id"]: u for u in snapshot["usage"]}
    assert len(usage) == len(snapshot["usage"])
    trails: dict[str, list[dict[str, Any]]] = {}
    for entry in sorted(snapshot["ledger"], key=lambda e: e["id"]):
        if entry["request_id"] is not None:
            trails.setdefault(entry["request_id"], []).append(entry)
    for request_id in set(reservations) | set(usage):
        trail = trails.get(request_id, [])
        kinds = [e["kind"] for e in trail]
        amounts = {e["kind"]: e["amount_micro_usd"] for e in trail}
        assert len(kinds) == len(set(kinds)), (request_id, kinds)
        held = reservations.get(request_id)
        row = usage.get(request_id)
        status = held["status"] if held else None
        assert (status == "settled" or (held is None and row is not None)) == (row is not None), (request_id, status)
        if held is not None:
            expected = {"open": ["reservation"], "refunded": ["reservation", "refund"]}.get(status)
            if expected is not None:
                assert kinds == expected, (request_id, status, kinds)
                continue
            assert kinds[:2] == ["reservation", "refund"], (request_id, kinds)
            assert amounts["reservation"] == -amounts["refund"] == -held["amount_micro_usd"]
        assert row is not None
        assert amounts.get("charge", 0) == -row["cost_micro_usd"], (request_id, kinds, row)
        assert amounts.get("platform_fee", 0) == row["platform_fee_micro_usd"], (request_id, kinds, row)
        assert amounts.get("payout", 0) == row["provider_payout_micro_usd"], (request_id, kinds, row)
    assert set(trails) <= set(reservations) | set(usage)
