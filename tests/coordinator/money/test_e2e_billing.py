"""Billing end to end: a real coordinator (SQLite and Postgres) and a real node on the bundled model,
driven over HTTP; the money is checked in the API and straight in the database."""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import httpx
import pytest

from darkbloom.store.schema import PLATFORM_ACCOUNT_ID, admin_credits, ledger_entries, reservations, usage_records

from tests.support.databases import database_for
from tests.support.billing import (billing_coordinator, credit, new_key, node_home, pockets,
                                   signup, start_serve, table, wait_log, wait_registered, wait_settled,
                                   write_catalog)
from tests.support.accounts import Account, create_account, device_token
from tests.support.processes import Coordinator, Process

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
INPUT_PRICE, OUTPUT_PRICE = 1_333_333, 4_666_667  # µUSD per 1M tokens: fractional per token, so ceil shows
FEE_BPS = 1_250
MIN_CHARGE = 100


def cost_of(prompt: int, completion: int) -> int:
    raw = math.ceil(Fraction(prompt * INPUT_PRICE, 10**6)) + math.ceil(Fraction(completion * OUTPUT_PRICE, 10**6))
    return max(MIN_CHARGE, raw)


def fee_of(cost: int) -> int:
    return cost * FEE_BPS // 10_000


@dataclass
class Real:
    coord: Coordinator
    url: str
    owner: Account
    node: Process
    provider_id: str


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    root = tmp_path_factory.mktemp("billing-e2e")
    with database_for(request.param, root) as url:
        catalog = write_catalog(root / "catalog.json", {"id": MODEL, "input_price": INPUT_PRICE,
                                                        "output_price": OUTPUT_PRICE, "max_output_tokens": 256})
        coord = billing_coordinator(root / "coordinator", url, catalog, "--platform-fee-bps", str(FEE_BPS),
                                    "--cancel-grace", "5")
        node = None
        try:
            owner = create_account(coord)
            node = start_serve(coord, node_home(root, "node", device_token(coord, owner)), "--max-concurrency", "2")
            provider_id = wait_registered(node)
            yield Real(coord, url, owner, node, provider_id)
        finally:
            if node is not None:
                node.stop()
            coord.stop()


def chat(real: Real, account: Account, content: str, max_tokens: int, stream: bool = False,
         key: str | None = None, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 0, **({"stream_options": {"include_usage": True}} if stream else {}),
            **fields}
    return httpx.post(real.coord.api_url + "/chat/completions", json=body, headers=account.headers(key), timeout=120)


def stream_usage(response: httpx.Response) -> dict[str, int]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return dict(json.loads(events[-2])["usage"])


def ledger_kinds(real: Real, request_id: str) -> list[tuple[str, str, int]]:
    entries = sorted(table(real.url, ledger_entries, ledger_entries.c.request_id == request_id), key=lambda e: e["id"])
    return [(e["account_id"], e["kind"], e["amount_micro_usd"]) for e in entries]


@pytest.mark.parametrize("stream", [False, True])
def test_paid_request_charges_catalog_cost_and_pays_the_owner(real: Real, stream: bool) -> None:
    consumer = create_account(real.coord, credit_micro_usd=1_000_000)
    before = {a: pockets(real.url, a) for a in (consumer.account_id, real.owner.account_id, PLATFORM_ACCOUNT_ID)}

    response = chat(real, consumer, "Write a short poem about the sea.", 48, stream=stream)
    assert response.status_code == 200, response.text
    usage = stream_usage(response) if stream else response.json()["usage"]
    request_id = response.headers["x-request-id"]
    assert response.headers["x-provider-id"] == real.provider_id
    wait_settled(real.url, request_ids=[request_id])

    cost = cost_of(usage["prompt_tokens"], usage["completion_tokens"])
    assert cost > MIN_CHARGE, usage  # the catalog price, not the minimum
    fee = fee_of(cost)
    assert pockets(real.url, consumer.account_id) == (before[consumer.account_id][0] - cost, 0)
    owner_before = before[real.owner.account_id]
    assert pockets(real.url, real.owner.account_id) == (owner_before[0], owner_before[1] + cost - fee)
    platform_before = before[PLATFORM_ACCOUNT_ID]
    assert pockets(real.url, PLATFORM_ACCOUNT_ID) == (platform_before[0], platform_before[1] + fee)
    assert httpx.get(real.coord.api_url + "/payments/balance", headers=consumer.headers()).json() == {
        "balance_micro_usd": 1_000_000 - cost, "withdrawable_micro_usd": 0}

    [row] = table(real.url, usage_records, usage_records.c.request_id == request_id)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_micro_usd"], row["platform_fee_micro_usd"],
            row["provider_payout_micro_usd"], row["provider_id"], row["provider_account_id"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], cost, fee, cost - fee, real.provider_id,
        real.owner.account_id)
    [reservation] = table(real.url, reservations, reservations.c.request_id == request_id)
    assert reservation["status"] == "settled" and reservation["amount_micro_usd"] >= cost
    assert ledger_kinds(real, request_id) == [
        (consumer.account_id, "reservation", -reservation["amount_micro_usd"]),
        (consumer.account_id, "refund", reservation["amount_micro_usd"]),
        (consumer.account_id, "charge", -cost),
        (PLATFORM_ACCOUNT_ID, "platform_fee", fee),
        (real.owner.account_id, "payout", cost - fee)]
    # the request's line, written once its answer has gone, says what its usage row says, once
    line = wait_log(real.coord.process, rf"request_id={request_id} .*outcome=ok prompt_tokens=(\d+) "
                                        rf"completion_tokens=(\d+)")
    assert (int(line.group(1)), int(line.group(2))) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert real.coord.process.log().count(f"request_id={request_id} ") == 1


def test_tiny_request_pays_the_minimum_charge(real: Real) -> None:
    consumer = create_account(real.coord, credit_micro_usd=10_000)
    response = chat(real, consumer, "Hi", 1)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    raw = (math.ceil(Fraction(usage["prompt_tokens"] * INPUT_PRICE, 10**6))
           + math.ceil(Fraction(usage["completion_tokens"] * OUTPUT_PRICE, 10**6)))
    assert raw < MIN_CHARGE
    assert pockets(real.url, consumer.account_id) == (10_000 - MIN_CHARGE, 0)
    [row] = table(real.url, usage_records, usage_records.c.request_id == response.headers["x-request-id"])
    assert row["cost_micro_usd"] == MIN_CHARGE and row["platform_fee_micro_usd"] == fee_of(MIN_CHARGE)


def test_usage_rows_newest_first_with_cursor_pagination(real: Real) -> None:
    consumer = create_account(real.coord, credit_micro_usd=100_000)
    sent = []
    for n in range(3):
        response = chat(real, consumer, f"Say the number {n}.", 4, stream=n == 1)
        assert response.status_code == 200, response.text
        usage = stream_usage(response) if n == 1 else response.json()["usage"]
        sent.append((response.headers["x-request-id"], response.headers["x-provider-id"], usage))
    url = real.coord.api_url + "/payments/usage"

    first = httpx.get(url, params={"limit": 2}, headers=consumer.headers())
    assert first.status_code == 200, first.text
    page1 = first.json()
    assert page1["object"] == "list" and isinstance(page1["next_cursor"], str)
    second = httpx.get(url, params={"limit": 2, "cursor": page1["next_cursor"]}, headers=consumer.headers()).json()
    assert second["next_cursor"] is None
    rows = page1["data"] + second["data"]
    assert [r["request_id"] for r in rows] == [s[0] for s in reversed(sent)]
    for row, (request_id, provider_id, usage) in zip(rows, reversed(sent)):
        assert set(row) == {"request_id", "created_at", "model", "provider_id", "prompt_tokens", "completion_tokens",
                            "cost_micro_usd", "self_routed", "routed"}
        assert row == {"request_id": request_id, "created_at": row["created_at"], "model": MODEL,
                       "provider_id": provider_id, "prompt_tokens": usage["prompt_tokens"],
                       "completion_tokens": usage["completion_tokens"],
                       "cost_micro_usd": cost_of(usage["prompt_tokens"], usage["completion_tokens"]),
                       "self_routed": False, "routed": "fleet"}
        assert isinstance(row["created_at"], int) and row["created_at"] > 1_600_000_000
    assert rows[0]["created_at"] >= rows[-1]["created_at"]
    # the whole list in one page, with the session token too
    everything = httpx.get(url, headers={"Authorization": f"Bearer {consumer.session}"}).json()
    assert [r["request_id"] for r in everything["data"]] == [s[0] for s in reversed(sent)]
    assert everything["next_cursor"] is None
    assert pockets(real.url, consumer.account_id)[0] == 100_000 - sum(r["cost_micro_usd"] for r in rows)
    # nobody else sees them
    stranger = create_account(real.coord)
    assert httpx.get(url, headers=stranger.headers()).json()["data"] == []
    bad = httpx.get(url, params={"cursor": "not-a-cursor"}, headers=consumer.headers())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"


def test_provider_earnings_list_the_owners_payouts(real: Real) -> None:
    consumer = create_account(real.coord, credit_micro_usd=100_000)
    request_ids = []
    for n in range(2):
        response = chat(real, consumer, f"Name a colour, please ({n}).", 6)
        assert response.status_code == 200, response.text
        request_ids.append(response.headers["x-request-id"])
    earnings = httpx.get(real.coord.api_url + "/provider/earnings", headers=real.owner.headers())
    assert earnings.status_code == 200, earnings.text
    body = earnings.json()
    owned = table(real.url, usage_records, usage_records.c.provider_account_id == real.owner.account_id)
    assert body["total_micro_usd"] == sum(r["provider_payout_micro_usd"] for r in owned)
    assert body["total_micro_usd"] == pockets(real.url, real.owner.account_id)[1]
    by_id = {r["request_id"]: r for r in body["data"]}
    for request_id in request_ids:
        [usage] = table(real.url, usage_records, usage_records.c.request_id == request_id)
        row = by_id[request_id]
        assert row["payout_micro_usd"] == usage["cost_micro_usd"] - fee_of(usage["cost_micro_usd"]) > 0
        assert (row["provider_id"], row["model"], row["prompt_tokens"], row["completion_tokens"]) == (
            real.provider_id, MODEL, usage["prompt_tokens"], usage["completion_tokens"])
    # newest first, paginated like usage
    page = httpx.get(real.coord.api_url + "/provider/earnings", params={"limit": 1},
                     headers=real.owner.headers()).json()
    assert page["data"][0]["request_id"] == body["data"][0]["request_id"] and page["next_cursor"] is not None
    # the consumer earned nothing
    assert httpx.get(real.coord.api_url + "/provider/earnings", headers=consumer.headers()).json()[
        "total_micro_usd"] == 0


def test_admin_credit_is_idempotent_and_ledgered(real: Real) -> None:
    account_id, session = signup(real.coord)
    reference = "invoice-" + secrets.token_hex(4)
    first = credit(real.coord, account_id, 5_000, reference)
    assert first.status_code == 200 and first.json()["balance_micro_usd"] == 5_000
    again = credit(real.coord, account_id, 5_000, reference)
    assert again.status_code == 200 and again.json()["balance_micro_usd"] == 5_000
    other_amount = credit(real.coord, account_id, 9_999, reference)  # same reference: still the first credit
    assert other_amount.json()["balance_micro_usd"] == 5_000
    second = credit(real.coord, account_id, 2_500, reference + "-b")
    assert second.json()["balance_micro_usd"] == 7_500
    [row] = table(real.url, admin_credits, admin_credits.c.reference == reference)
    assert (row["account_id"], row["amount_micro_usd"]) == (account_id, 5_000)
    entries = table(real.url, ledger_entries, ledger_entries.c.account_id == account_id)
    assert sorted((e["kind"], e["amount_micro_usd"], e["balance_after"], e["reference"]) for e in entries) == [
        ("admin_credit", 2_500, 7_500, reference + "-b"), ("admin_credit", 5_000, 5_000, reference)]
    assert httpx.get(real.coord.api_url + "/payments/balance",
                     headers={"Authorization": f"Bearer {session}"}).json()["balance_micro_usd"] == 7_500
    # errors change nothing
    unknown = credit(real.coord, "acct_nobody", 1_000)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "account_not_found"
    for amount in (0, -5, 1.5, "100"):
        bad = credit(real.coord, account_id, amount)  # type: ignore[arg-type]
        assert bad.status_code == 400, (amount, bad.text)
    not_admin = httpx.post(real.coord.api_url + "/admin/credit", headers={"Authorization": f"Bearer {session}"},
                           json={"account_id": account_id, "amount_micro_usd": 1, "reference": "x"})
    assert not_admin.status_code in (401, 403)
    assert pockets(real.url, account_id) == (7_500, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_request_failing_before_completion_is_fully_refunded(real: Real, stream: bool) -> None:
    consumer = create_account(real.coord, credit_micro_usd=50_000)
    owner_before = pockets(real.url, real.owner.account_id)
    # the node's backend rejects the malformed `stop` (the coordinator passes it through) before generating
    response = chat(real, consumer, "Hello", 16, stream=stream, stop=5)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    [reservation] = table(real.url, reservations, reservations.c.account_id == consumer.account_id)
    wait_settled(real.url, request_ids=[reservation["request_id"]])
    [reservation] = table(real.url, reservations, reservations.c.account_id == consumer.account_id)
    assert reservation["status"] == "refunded"
    assert table(real.url, usage_records, usage_records.c.account_id == consumer.account_id) == []
    assert pockets(real.url, consumer.account_id) == (50_000, 0)
    assert pockets(real.url, real.owner.account_id) == owner_before
    assert [k for _, k, _ in ledger_kinds(real, reservation["request_id"])] == ["reservation", "refund"]


def test_refusals_before_dispatch_leave_no_trace(real: Real) -> None:
    poor = create_account(real.coord, credit_micro_usd=150)
    refused = chat(real, poor, "Hello", 200)
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["type"] == "insufficient_funds"
    assert refused.json()["error"]["code"] == "insufficient_quota"
    capped_account = create_account(real.coord, credit_micro_usd=100_000)
    capped = new_key(real.coord, capped_account.session, limit_usd=0.0005)  # 500 µUSD
    over_cap = chat(real, capped_account, "Hello", 200, key=capped["key"])
    assert over_cap.status_code == 402, over_cap.text
    assert over_cap.json()["error"]["type"] == over_cap.json()["error"]["code"] == "spend_cap_exceeded"
    for account, credited in ((poor, 150), (capped_account, 100_000)):
        assert table(real.url, reservations, reservations.c.account_id == account.account_id) == []
        assert pockets(real.url, account.account_id) == (credited, 0)
    # within the cap the same key works, and what it spent counts against the cap
    small = chat(real, capped_account, "Hi", 1, key=capped["key"])
    assert small.status_code == 200, small.text
    assert pockets(real.url, capped_account.account_id) == (100_000 - MIN_CHARGE, 0)


def test_client_disconnecting_mid_stream_is_charged_for_the_partial_tokens(real: Real) -> None:
    consumer = create_account(real.coord, credit_micro_usd=1_000_000)
    body = {"model": MODEL, "stream": True, "max_tokens": 256, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
    received = 0
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", real.coord.api_url + "/chat/completions", json=body,
                           headers=consumer.headers()) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                    received += 1
                    if received == 3:
                        break  # walk away mid-stream
    wait_settled(real.url, timeout=30, request_ids=[request_id])
    [reservation] = table(real.url, reservations, reservations.c.request_id == request_id)
    assert reservation["status"] == "settled", "the partial usage was not reported in time: refunded instead"
    # what the node says it used before it stopped
    match = wait_log(real.node, rf"request {request_id} cancelled after (\d+) prompt \+ (\d+) completion tokens")
    prompt, completion = int(match.group(1)), int(match.group(2))
    [row] = table(real.url, usage_records, usage_records.c.request_id == request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
    assert prompt > 0 and 3 <= completion < 256
    cost = cost_of(prompt, completion)
    assert row["cost_micro_usd"] == cost and row["provider_payout_micro_usd"] == cost - fee_of(cost)
    assert pockets(real.url, consumer.account_id) == (1_000_000 - cost, 0)
    assert re.search(rf"request_id={request_id} .*outcome=client_disconnected\b", real.coord.process.log())
