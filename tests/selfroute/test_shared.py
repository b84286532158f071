"""Shared routing (docs/sharing.md): `X-Darkbloom-Route: shared` over the caller's own machines and
those shared with them — own first, never the public fleet — free or at the share's prices, with
daily limits that concurrency never overshoots, revocation that takes effect at once, and the
edges of issue 23 (a share expiring or its machine unlinked mid-request, a grantee at zero balance,
the owner's own requests never counted against a share).

The machines run the `openai` backend in front of bench/fixed_upstream.py; another account's machine
serves the same model to the public fleet throughout, so a request that leaked to the fleet would
land on it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import httpx
import pytest

from tests.selfroute.support import (FIXED_ANSWER, SELF, Node, Stack, error_of, start_upstream, streamed_text,
                                     wait_accepted)
from tests.support.accounts import Account
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

SHARED = {"X-Darkbloom-Route": "shared"}
FEE_BPS = 500
CREDIT = 10_000_000
IN_PRICE, OUT_PRICE = 400_000, 1_600_000  # a priced share's µUSD per 1M tokens


@dataclass
class World:
    stack: Stack
    fast: str       # the instant upstream
    slow: str       # one chunk every 0.3 s
    public: Node    # another account's machine, in the public fleet


@pytest.fixture(autouse=True)
def clear_of_midnight() -> None:
    """A share's limits and counts are per UTC day: a test that would start within a minute of 00:00 UTC
    waits for the new day, so none straddles it (each takes seconds)."""
    left = 86_400 - time.time() % 86_400
    if left < 60:
        time.sleep(left + 1)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, replicated: bool) -> Iterator[World]:
    root = tmp_path_factory.mktemp("shared")
    stack = Stack.start(root, "--platform-fee-bps", str(FEE_BPS), "--queue-max-wait", "2", replicated=replicated)
    try:
        fast, fast_url = start_upstream(root / "fast")
        slow, slow_url = start_upstream(root / "slow", "--delay", "0.3")
        stack.processes += [fast, slow]
        public = stack.node("public", stack.account(), upstream=fast_url)
        yield World(stack, fast_url, slow_url, public)
    finally:
        stack.close()


def share(stack: Stack, owner: Account, grantee: Account | str, *, accept: bool = True,
          **fields: Any) -> dict[str, Any]:
    """A share from ``owner``; to an account, accepted with its invite code unless ``accept`` is False."""
    email = grantee if isinstance(grantee, str) else grantee.email
    response = httpx.post(stack.url + "/shares", json={"email": email, **fields},
                          headers={"Authorization": f"Bearer {owner.session}"}, timeout=30)
    assert response.status_code == 201, response.text
    given = dict(response.json())
    assert given["status"] == "pending" and given["invite_code"].startswith("dki-"), given
    if accept and not isinstance(grantee, str):
        accepted = redeem(stack, grantee, given["invite_code"])
        assert accepted.status_code == 201 and accepted.json()["status"] == "accepted", accepted.text
    return given


def redeem(stack: Stack, account: Account, invite_code: str) -> httpx.Response:
    return httpx.post(stack.url + "/shares/accept", json={"invite_code": invite_code},
                      headers={"Authorization": f"Bearer {account.session}"}, timeout=30)


def answer(stack: Stack, account: Account, share_id: str, verb: str, **shown: Any) -> httpx.Response:
    return httpx.post(f"{stack.url}/shares/{share_id}/{verb}", json=shown,
                      headers={"Authorization": f"Bearer {account.session}"}, timeout=30)


def change(stack: Stack, owner: Account, share_id: str, **fields: Any) -> dict[str, Any]:
    response = httpx.patch(f"{stack.url}/shares/{share_id}", json=fields,
                           headers={"Authorization": f"Bearer {owner.session}"}, timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json())


def share_usage(stack: Stack, account: Account, share_id: str) -> dict[str, Any]:
    response = stack.get(f"/shares/{share_id}/usage", account.session)
    assert response.status_code == 200, response.text
    return dict(response.json())


def revoke(stack: Stack, account: Account, share_id: str) -> None:
    response = httpx.delete(f"{stack.url}/shares/{share_id}", headers={"Authorization": f"Bearer {account.session}"},
                            timeout=30)
    assert response.status_code == 204, response.text


def household(world: World, *, upstream: str | None = None, max_concurrency: int = 2,
              first_token_delay: float = 0.0, **share_fields: Any) -> tuple[Account, Node, Account, dict[str, Any]]:
    """An owner with one machine, and a grantee (no machine, no credit) it is shared with."""
    s = world.stack
    owner, grantee = s.account(), s.account()
    node = s.node(f"home-{owner.account_id[-6:]}", owner, upstream=upstream or world.fast,
                  max_concurrency=max_concurrency, first_token_delay=first_token_delay)
    s.wait_listed(owner, node.session_id)
    return owner, node, grantee, share(s, owner, grantee, **share_fields)


def test_a_free_share_serves_the_grantee_on_the_owners_machine_for_nothing(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world)
    public_before = len(world.public.accepted())
    for stream in (False, True):
        if stream:
            response, text = s.stream(grantee.api_key, SHARED)
            assert streamed_text(text) == FIXED_ANSWER
        else:
            response = s.chat(grantee.api_key, SHARED)
            assert response.json()["choices"][0]["message"]["content"] == FIXED_ANSWER
        assert response.status_code == 200
        assert response.headers["x-provider-id"] == home.session_id
        assert response.headers["x-darkbloom-routed"] == "shared"
        assert response.headers["x-darkbloom-billing"] == "free"
    rows = [r for r in s.usage(grantee) if r["share_id"] == given["id"]]
    assert len(rows) == 2 and all(r["routed"] == "shared" and r["cost_micro_usd"] == 0
                                  and r["self_routed"] is False for r in rows), rows
    assert s.balance(grantee) == 0 and s.earnings(owner)["total_micro_usd"] == 0
    for reader in (owner, grantee):
        used = share_usage(s, reader, given["id"])
        assert used["today"]["requests"] == 2 and len(used["data"]) == 2
    assert len(world.public.accepted()) == public_before  # never the fleet
    listed = s.get("/models", grantee.api_key, SHARED)
    assert [m["id"] for m in listed.json()["data"]] == ["smollm2-135m"], listed.text


def test_the_shared_model_list_is_empty_with_nothing_shared(world: World) -> None:
    s = world.stack
    lonely = s.account()
    assert s.get("/models", lonely.api_key, SHARED).json()["data"] == []


def test_nothing_owned_and_nothing_shared_is_409(world: World) -> None:
    s = world.stack
    lonely = s.account(credit=CREDIT)
    response = s.chat(lonely.api_key, SHARED)
    assert response.status_code == 409 and error_of(response)["code"] == "no_shared_machine", response.text


def test_the_callers_own_machine_comes_first(world: World) -> None:
    s = world.stack
    owner, home, grantee, _ = household(world)
    mine = s.node(f"own-{grantee.account_id[-6:]}", grantee, upstream=world.fast)
    s.wait_listed(grantee, mine.session_id)
    for _ in range(3):
        response = s.chat(grantee.api_key, SHARED)
        assert response.status_code == 200, response.text
        assert response.headers["x-provider-id"] == mine.session_id
        assert response.headers["x-darkbloom-routed"] == "owned"
    mine.stop()


def test_the_share_header_narrows_and_is_checked(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world)
    narrowed = s.chat(grantee.api_key, {**SHARED, "X-Darkbloom-Share": given["id"]})
    assert narrowed.status_code == 200 and narrowed.headers["x-darkbloom-routed"] == "shared", narrowed.text
    other_owner, _, _, not_mine = household(world)
    for share_id in ("shr_doesnotexist", not_mine["id"]):
        refused = s.chat(grantee.api_key, {**SHARED, "X-Darkbloom-Share": share_id})
        assert refused.status_code == 404 and error_of(refused)["code"] == "share_not_found", refused.text
    without = s.chat(grantee.api_key, {"X-Darkbloom-Share": given["id"]})
    assert without.status_code == 400 and error_of(without)["param"] == "X-Darkbloom-Share", without.text


def test_a_shared_only_key_routes_shared_and_self_route_only_wins(world: World) -> None:
    s = world.stack
    owner, home, grantee, _ = household(world)
    shared_key = s.key(grantee, shared_only=True)
    response = s.chat(shared_key)
    assert response.status_code == 200 and response.headers["x-darkbloom-routed"] == "shared", response.text
    both = s.key(grantee, shared_only=True, self_route_only=True)
    refused = s.chat(both)
    assert refused.status_code == 409 and error_of(refused)["code"] == "no_linked_machine", refused.text


def test_a_priced_share_charges_its_prices_and_pays_the_owner(world: World) -> None:
    s = world.stack
    owner, home, _, _ = household(world)
    funded = s.account(credit=CREDIT)
    given = share(s, owner, funded, input_price=IN_PRICE, output_price=OUT_PRICE)
    platform_before = s.platform_withdrawable()
    response = s.chat(funded.api_key, SHARED)
    assert response.status_code == 200, response.text
    assert response.headers["x-darkbloom-routed"] == "shared" and response.headers["x-darkbloom-billing"] == "charged"
    usage = response.json()["usage"]
    row = next(r for r in s.usage(funded) if r["request_id"] == response.headers["x-request-id"])
    expected = max(100, -(-usage["prompt_tokens"] * IN_PRICE // 1_000_000)
                   + -(-usage["completion_tokens"] * OUT_PRICE // 1_000_000))
    assert (row["routed"], row["share_id"], row["cost_micro_usd"]) == ("shared", given["id"], expected)
    assert s.balance(funded) == CREDIT - expected
    fee = expected * FEE_BPS // 10_000
    assert s.earnings(owner)["total_micro_usd"] == expected - fee
    assert s.platform_withdrawable() - platform_before == fee  # conserved to the µUSD


def test_a_priced_share_refuses_a_grantee_at_zero_balance_and_reserves_nothing(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world, input_price=IN_PRICE, output_price=OUT_PRICE)
    before = len(home.accepted())
    response = s.chat(grantee.api_key, SHARED)
    assert response.status_code == 402 and error_of(response)["code"] == "insufficient_quota", response.text
    assert s.balance(grantee) == 0 and s.usage(grantee) == [] and len(home.accepted()) == before
    assert share_usage(s, owner, given["id"])["today"]["requests"] == 0


def test_a_daily_request_limit_holds_under_a_race_and_says_when_it_resets(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world, upstream=world.slow, max_concurrency=8, daily_request_limit=3)
    assert s.chat(grantee.api_key, SHARED).status_code == 200
    assert s.chat(grantee.api_key, SHARED).status_code == 200
    with ThreadPoolExecutor(6) as pool:  # the last request of the day, raced six times
        responses = list(pool.map(lambda _: s.chat(grantee.api_key, SHARED), range(6)))
    assert sorted(r.status_code for r in responses) == [200] + [429] * 5, [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 429)
    assert error_of(refused)["code"] == "share_quota_exceeded"
    midnight = 86_400 - int(time.time()) % 86_400
    assert abs(int(refused.headers["retry-after"]) - midnight) <= 5
    assert share_usage(s, grantee, given["id"])["today"]["requests"] == 3
    own = s.chat(owner.api_key, SELF)  # the owner's own requests never count against the share
    assert own.status_code == 200 and own.headers["x-darkbloom-routed"] == "owned"
    assert share_usage(s, owner, given["id"])["today"]["requests"] == 3


def test_a_daily_token_limit_counts_what_was_used(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world, daily_token_limit=400)
    served = s.chat(grantee.api_key, SHARED, max_tokens=16)
    assert served.status_code == 200, served.text
    used = served.json()["usage"]
    today = share_usage(s, grantee, given["id"])["today"]
    assert today["prompt_tokens"] + today["completion_tokens"] == used["prompt_tokens"] + used["completion_tokens"]
    too_much = s.chat(grantee.api_key, SHARED, max_tokens=1000)  # its worst case cannot fit what is left
    assert too_much.status_code == 429 and error_of(too_much)["code"] == "share_quota_exceeded", too_much.text


def test_only_the_shared_machines_serve(world: World) -> None:
    s = world.stack
    owner, grantee = s.account(), s.account()
    shared_one = s.node(f"a-{owner.account_id[-6:]}", owner, upstream=world.fast)
    private_one = s.node(f"b-{owner.account_id[-6:]}", owner, upstream=world.fast)
    for node in (shared_one, private_one):
        s.wait_listed(owner, node.session_id)
    share(s, owner, grantee, machines=[s.machine_of(owner, shared_one.session_id)])
    for _ in range(4):
        response = s.chat(grantee.api_key, SHARED)
        assert response.status_code == 200 and response.headers["x-provider-id"] == shared_one.session_id
    shared_one.stop()
    wait_until(lambda: not any(m["online"] for m in s.machines(owner) if m["session_id"] == shared_one.session_id),
               timeout=30, interval=0.1, what="the shared machine offline")
    response = s.chat(grantee.api_key, SHARED)  # the other machine is not shared, and never the fleet
    assert response.status_code == 503 and error_of(response)["code"] == "machine_offline", response.text
    private_one.stop()


def test_revoking_refuses_new_requests_at_once_and_lets_one_in_flight_finish(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world, upstream=world.slow)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(s.stream, grantee.api_key, SHARED)
        wait_accepted(home, in_flight)
        revoke(s, grantee, given["id"])  # the grantee may revoke too
        refused = s.chat(grantee.api_key, SHARED)
        assert refused.status_code == 409 and error_of(refused)["code"] == "no_shared_machine", refused.text
        response, text = in_flight.result(timeout=60)
    assert response.status_code == 200 and streamed_text(text) == FIXED_ANSWER
    row = next(r for r in s.usage(grantee) if r["request_id"] == response.headers["x-request-id"])
    assert (row["routed"], row["share_id"], row["cost_micro_usd"]) == ("shared", given["id"], 0)


def test_a_share_expiring_mid_stream_settles_at_its_terms(world: World) -> None:
    s = world.stack
    owner = s.account()
    node = s.node(f"exp-{owner.account_id[-6:]}", owner, upstream=world.slow)
    s.wait_listed(owner, node.session_id)
    funded = s.account(credit=CREDIT)
    expires = (datetime.now(timezone.utc) + timedelta(seconds=4)).isoformat()
    given = share(s, owner, funded, input_price=IN_PRICE, output_price=OUT_PRICE, expires_at=expires)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(s.stream, funded.api_key, SHARED)
        wait_accepted(node, in_flight)
        response, text = in_flight.result(timeout=60)
    assert response.status_code == 200 and streamed_text(text) == FIXED_ANSWER
    wait_until(lambda: time.time() > datetime.fromisoformat(expires).timestamp() + 0.5, timeout=10, interval=0.1,
               what="the share expired")
    row = next(r for r in s.usage(funded) if r["request_id"] == response.headers["x-request-id"])
    assert row["routed"] == "shared" and row["share_id"] == given["id"] and row["cost_micro_usd"] >= 100
    refused = s.chat(funded.api_key, SHARED)
    assert refused.status_code == 409 and error_of(refused)["code"] == "no_shared_machine", refused.text
    node.stop()


def test_an_owner_unlinking_a_shared_machine_mid_request_costs_the_grantee_nothing(world: World) -> None:
    s = world.stack
    owner = s.account()
    node = s.node(f"unl-{owner.account_id[-6:]}", owner, upstream=world.slow)
    s.wait_listed(owner, node.session_id)
    funded = s.account(credit=CREDIT)
    share(s, owner, funded, input_price=IN_PRICE, output_price=OUT_PRICE)
    machine = s.machine_of(owner, node.session_id)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(s.chat, funded.api_key, SHARED)
        wait_accepted(node, in_flight)
        unlinked = httpx.delete(f"{s.url}/me/providers/{machine}", headers={"Authorization": f"Bearer {owner.session}"},
                                timeout=30)
        assert unlinked.status_code == 200, unlinked.text
        response = in_flight.result(timeout=60)
    rows = s.usage(funded)
    if response.status_code == 200:  # it finished before the session closed: at the share's terms, or free
        row = next(r for r in rows if r["request_id"] == response.headers["x-request-id"])
        assert row["routed"] == "shared"
    else:  # the machine went away before the answer: nothing charged, nothing left reserved
        assert rows == [], rows
    assert s.balance(funded) + sum(r["cost_micro_usd"] for r in rows) == CREDIT


# consent (docs/sharing.md "Consent"): a share routes nothing until its grantee accepts it

def test_a_share_nobody_accepted_is_never_routed_to_and_never_charges(world: World) -> None:
    """Issue 45's high findings: a stranger's share to your email, priced at the most the bounds allow,
    while the machine you normally use is offline, costs you nothing and never sees your prompt."""
    s = world.stack
    friend, you = s.account(), s.account(credit=CREDIT)
    friends_machine = s.node(f"friend-{friend.account_id[-6:]}", friend, upstream=world.fast)
    s.wait_listed(friend, friends_machine.session_id)
    share(s, friend, you)
    friends_machine.stop()
    stranger = s.account()
    strangers_machine = s.node(f"stranger-{stranger.account_id[-6:]}", stranger, upstream=world.fast,
                               max_concurrency=4)
    s.wait_listed(stranger, strangers_machine.session_id)
    priced = share(s, stranger, you, accept=False, input_price=10**12, output_price=10**12)
    free = share(s, stranger, you, accept=False)
    wait_until(lambda: not any(m["online"] for m in s.machines(friend)), timeout=30, interval=0.1,
               what="the friend's machine offline")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: s.chat(you.api_key, SHARED, max_tokens=8), range(4)))
    assert {(r.status_code, error_of(r)["code"]) for r in answers} == {(503, "machine_offline")}, \
        [r.text for r in answers]
    assert strangers_machine.accepted() == [] and s.balance(you) == CREDIT and s.usage(you) == []
    for pending in (priced, free):
        named = s.chat(you.api_key, {**SHARED, "X-Darkbloom-Share": pending["id"]})
        assert named.status_code == 409 and error_of(named)["code"] == "share_not_accepted", named.text
        assert error_of(named)["param"] == "X-Darkbloom-Share"
    assert s.get("/models", you.api_key, SHARED).json()["data"] == []
    assert strangers_machine.accepted() == [] and s.balance(you) == CREDIT
    assert s.earnings(stranger)["total_micro_usd"] == 0
    strangers_machine.stop()


def test_accepting_by_invite_code_routes_and_declining_stops_it(world: World) -> None:
    s = world.stack
    owner, home, grantee, given = household(world)
    assert s.chat(grantee.api_key, SHARED).status_code == 200
    listed = s.get("/shares", grantee.session).json()["received"]
    assert [(r["id"], r["status"], r["owner_email"]) for r in listed] == [(given["id"], "accepted", owner.email)]
    assert "invite_code" not in listed[0] and "invite_code" not in s.get("/shares", owner.session).json()["given"][0]
    again = redeem(s, grantee, given["invite_code"])  # a code is spent once used
    assert again.status_code == 404 and error_of(again)["code"] == "share_not_found", again.text
    assert redeem(s, s.account(), "dki-not-a-code").status_code == 404
    declined = answer(s, grantee, given["id"], "decline")
    assert declined.status_code == 200 and declined.json()["status"] == "declined", declined.text
    refused = s.chat(grantee.api_key, SHARED)
    assert refused.status_code == 409 and error_of(refused)["code"] == "no_shared_machine", refused.text
    assert s.get("/shares", owner.session).json()["given"][0]["status"] == "declined"
    accepted = answer(s, grantee, given["id"], "accept")  # the account it is bound to may change its mind
    assert accepted.status_code == 200 and accepted.json()["status"] == "accepted", accepted.text
    assert s.chat(grantee.api_key, SHARED).status_code == 200


def test_an_invite_code_binds_the_share_to_whoever_redeems_it_first(world: World) -> None:
    s = world.stack
    owner = s.account()
    partner, someone_else = s.account(), s.account()
    given = share(s, owner, partner, accept=False)
    assert redeem(s, owner, given["invite_code"]).status_code == 404  # not the owner's own
    assert redeem(s, someone_else, given["invite_code"]).status_code == 201
    taken = answer(s, partner, given["id"], "accept")  # bound to the account that redeemed it
    assert taken.status_code == 404 and error_of(taken)["code"] == "share_not_found", taken.text
    assert s.get("/shares", partner.session).json()["received"] == []


def test_new_prices_put_a_share_back_to_pending_until_they_are_accepted(world: World) -> None:
    s = world.stack
    owner = s.account()
    home = s.node(f"reprice-{owner.account_id[-6:]}", owner, upstream=world.fast)
    s.wait_listed(owner, home.session_id)
    funded = s.account(credit=CREDIT)
    given = share(s, owner, funded)
    assert s.chat(funded.api_key, SHARED).headers["x-darkbloom-billing"] == "free"
    assert change(s, owner, given["id"], daily_request_limit=50)["status"] == "accepted"  # not a term
    repriced = change(s, owner, given["id"], input_price=IN_PRICE, output_price=OUT_PRICE)
    assert repriced["status"] == "pending"
    refused = s.chat(funded.api_key, {**SHARED, "X-Darkbloom-Share": given["id"]})
    assert refused.status_code == 409 and error_of(refused)["code"] == "share_not_accepted", refused.text
    assert s.balance(funded) == CREDIT
    stale = answer(s, funded, given["id"], "accept", input_price=0, output_price=0)
    assert stale.status_code == 409 and error_of(stale)["code"] == "share_terms_changed", stale.text
    shown = answer(s, funded, given["id"], "accept", input_price=IN_PRICE, output_price=OUT_PRICE, machines="all")
    assert shown.status_code == 200 and shown.json()["status"] == "accepted", shown.text
    paid = s.chat(funded.api_key, SHARED)
    assert paid.status_code == 200 and paid.headers["x-darkbloom-billing"] == "charged", paid.text
    home.stop()


def test_a_keys_max_shared_price_keeps_it_off_dearer_shares(world: World) -> None:
    s = world.stack
    owner = s.account()
    home = s.node(f"ceiling-{owner.account_id[-6:]}", owner, upstream=world.fast)
    s.wait_listed(owner, home.session_id)
    funded = s.account(credit=CREDIT)
    given = share(s, owner, funded, input_price=IN_PRICE, output_price=OUT_PRICE)
    capped = s.key(funded, max_shared_price=IN_PRICE)  # the output price is above it
    refused = s.chat(capped, SHARED)
    assert refused.status_code == 409 and error_of(refused)["code"] == "no_shared_machine", refused.text
    named = s.chat(capped, {**SHARED, "X-Darkbloom-Share": given["id"]})
    assert named.status_code == 403 and error_of(named)["code"] == "share_price_above_key_ceiling", named.text
    assert s.balance(funded) == CREDIT and home.accepted() == []
    roomy = s.key(funded, max_shared_price=OUT_PRICE)
    served = s.chat(roomy, SHARED)
    assert served.status_code == 200 and served.headers["x-darkbloom-billing"] == "charged", served.text
    home.stop()
