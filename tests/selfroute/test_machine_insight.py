"""Machine insight through real processes: a coordinator (SQLite, then Postgres) with raw provider
sockets each put in one state that keeps it from public requests (busy, below the trust floor,
private_only, without the capability asked for, other weights than the catalog pins) while a public
machine serves every request. Each owner reads `GET /v1/me/providers/{id}/stats` and finds its
machine passed over once per public request, for its reason; the serving machine's requests,
tokens, hourly buckets and earnings come from the usage rows, and the consumer's
`/v1/payments/usage/daily` and `/v1/payments/usage.csv` sum and list the same rows.
"""

from __future__ import annotations

import concurrent.futures
import csv
import datetime
import io
import json
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from tests.selfroute.support import MODEL, SELF, Stack
from tests.support.accounts import Account
from tests.support.databases import database_for
from tests.support.processes import start_coordinator, wait_until
from tests.support.raw_provider import ThreadedRaw

pytestmark = pytest.mark.e2e

GOOD = "sha256:" + "a" * 64
BAD = "sha256:" + "b" * 64
CREDIT = 10_000_000
PUBLIC_REQUESTS = 3
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
# the reason each raw machine below is passed over for, and how it is put in that state
STATES: dict[str, dict[str, Any]] = {
    "busy": {"max_concurrency": 1},                         # held by its owner's own request
    "trust_floor": {"tamper_attestation": True},            # trust none under --min-trust self_signed
    "private_only": {"private_only": True},
    "capability": {"capabilities": ()},                     # the requests ask for tools
    "unverified_weights": {"model_fields": {"weight_hash": BAD}},
}


@dataclass
class World:
    stack: Stack
    consumer: Account
    host: Account
    server: ThreadedRaw
    owners: dict[str, Account]
    raws: dict[str, ThreadedRaw]
    held: str                  # the busy machine's own request, answered after the public ones
    served: list[str]          # the public requests' ids


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp(f"insight-{request.param}")
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [
        {"id": MODEL, "input_price": 50_000, "output_price": 200_000, "weight_hash": GOOD}]}))
    with database_for(request.param, root) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        coordinator = start_coordinator(root / "coordinator", url, "--catalog", str(catalog),
                                        "--min-trust", "self_signed", env={"DARKBLOOM_INSIGHT_INTERVAL": "0.5"})
        stack = Stack(root, coordinator)
        try:
            host = stack.account()
            server = stack.raw(host, answer="Served.", max_concurrency=8, capabilities=("tools",),
                               model_fields={"weight_hash": GOOD})
            owners = {reason: stack.account() for reason in STATES}
            raws = {}
            for reason, options in STATES.items():
                options = {"capabilities": ("tools",), "model_fields": {"weight_hash": GOOD}, **options}
                raws[reason] = stack.raw(owners[reason], **options)
            # the busy machine's one slot taken by its owner's own request (never a public one)
            holding = pool.submit(stack.chat, owners["busy"].api_key, SELF)
            held = wait_until(lambda: raws["busy"].requests[:1] or None, timeout=30, what="the held request")[0]
            consumer = stack.account(credit=CREDIT)
            served = []
            for _ in range(PUBLIC_REQUESTS):
                response = stack.chat(consumer.api_key, tools=TOOLS)
                assert response.status_code == 200, response.text
                assert response.headers["x-provider-id"] == server.session_id
                served.append(response.json()["id"])
            raws["busy"].chunk(held, "Mine.")
            raws["busy"].complete(held, prompt_tokens=4, completion_tokens=3)
            assert holding.result(30).status_code == 200
            yield World(stack, consumer, host, server, owners, raws, held, served)
        finally:
            stack.close()


def _stats(w: World, owner: Account, session_id: str) -> dict[str, Any]:
    machine = w.stack.machine_of(owner, session_id)
    response = w.stack.get(f"/me/providers/{machine}/stats", owner.session)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_each_machine_is_passed_over_once_per_public_request_for_its_reason(world: World) -> None:
    w = world
    for reason, raw in w.raws.items():
        expected = {reason: PUBLIC_REQUESTS}
        wait_until(lambda: {r: n for r, n in _stats(w, w.owners[reason], raw.session_id)["passed_over"].items()
                            if n} == expected or None, timeout=20, what=f"{reason} counted")
        assert raw.requests == ([w.held] if reason == "busy" else [])  # no public request reached it
    # the serving machine was never passed over
    assert not any(_stats(w, w.host, w.server.session_id)["passed_over"].values())
    # and a later count adds nothing (each request counts once)
    for reason, raw in w.raws.items():
        passed = _stats(w, w.owners[reason], raw.session_id)["passed_over"]
        assert {r: n for r, n in passed.items() if n} == {reason: PUBLIC_REQUESTS}


def test_requests_tokens_and_earnings_come_from_the_usage_rows(world: World) -> None:
    w, s = world, world.stack
    rows = {row["request_id"]: row for row in s.usage(w.consumer)}
    assert set(rows) == set(w.served)
    stats = _stats(w, w.host, w.server.session_id)
    assert stats["requests"] == {"owned": 0, "shared": 0, "fleet": PUBLIC_REQUESTS}
    assert stats["prompt_tokens"] == sum(row["prompt_tokens"] for row in rows.values()) > 0
    assert stats["completion_tokens"] == sum(row["completion_tokens"] for row in rows.values()) > 0
    earnings = s.earnings(w.host)
    assert stats["earnings_micro_usd"] == sum(item["payout_micro_usd"] for item in earnings["data"]) > 0
    assert stats["earnings_micro_usd"] == earnings["total_micro_usd"]
    assert sum(hour["fleet"] for hour in stats["hourly"]) == PUBLIC_REQUESTS
    mine = _stats(w, w.owners["busy"], w.raws["busy"].session_id)
    assert mine["requests"] == {"owned": 1, "shared": 0, "fleet": 0}
    assert (mine["prompt_tokens"], mine["completion_tokens"], mine["earnings_micro_usd"]) == (4, 3, 0)
    assert mine["busy_fraction"] is None or 0 <= mine["busy_fraction"] <= 1


def test_usage_per_day_and_csv_hold_the_consumer_s_rows(world: World) -> None:
    w, s = world, world.stack
    rows = s.usage(w.consumer)
    response = s.get("/payments/usage/daily?days=7", w.consumer.session)
    assert response.status_code == 200, response.text
    days = response.json()["data"]
    today = datetime.datetime.now(datetime.timezone.utc).date()
    yesterday = today - datetime.timedelta(days=1)  # when the call straddled 00:00 UTC
    assert len(days) == 7 and days[-1]["date"] in (today.isoformat(), yesterday.isoformat())
    # the requests of this module's world: on the last day, or the last two when 00:00 UTC came between
    assert all(d["requests"] == d["cost_micro_usd"] == 0 for d in days[:-2])
    totals = {k: sum(d[k] for d in days[-2:]) for k in ("requests", "prompt_tokens", "completion_tokens",
                                                          "cost_micro_usd")}
    assert totals == {"requests": PUBLIC_REQUESTS, "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                      "completion_tokens": sum(r["completion_tokens"] for r in rows),
                      "cost_micro_usd": sum(r["cost_micro_usd"] for r in rows)}
    assert totals["cost_micro_usd"] > 0
    exported = s.get("/payments/usage.csv", w.consumer.api_key)
    assert exported.status_code == 200 and exported.headers["content-type"].startswith("text/csv")
    assert "attachment" in exported.headers["content-disposition"]
    lines = list(csv.DictReader(io.StringIO(exported.text)))
    assert [line["request_id"] for line in lines] == [r["request_id"] for r in rows]  # newest first
    for line, row in zip(lines, rows):
        assert int(line["cost_micro_usd"]) == row["cost_micro_usd"]
        assert (line["model"], line["routed"], line["self_routed"], line["share_id"]) == (
            row["model"], "fleet", "false", "")
