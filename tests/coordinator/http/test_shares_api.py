"""Shares as objects (docs/sharing.md): give, list, revoke, read their use; every bad input a named
error, and nothing that tells whether an email has an account."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error, bearer, unique_email


def _share(api: Api, owner: Account, **fields: Any) -> dict[str, Any]:
    resp = api.post("/v1/shares", json=fields, headers=owner.auth)
    assert resp.status_code == 201, resp.text
    return resp.json()


def _redeem(api: Api, grantee: Account, share: dict[str, Any]) -> dict[str, Any]:
    resp = api.post("/v1/shares/accept", json={"invite_code": share["invite_code"]}, headers=grantee.auth)
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def _lists(api: Api, account: Account) -> dict[str, list[dict[str, Any]]]:
    resp = api.get("/v1/shares", headers=account.auth)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_share_with_every_field(api: Api) -> None:
    owner, grantee = api.signup(), api.signup()
    machine = api.link_machine(owner)["machine_id"]
    expires = (datetime.now(timezone.utc) + timedelta(days=7)).replace(microsecond=0)
    share = _share(api, owner, email=f"  {grantee.email.upper()} ", machines=[machine, machine],
                   daily_request_limit=200, daily_token_limit=100_000, input_price=20_000, output_price=80_000,
                   expires_at=expires.isoformat())
    assert share["id"].startswith("shr_") and share["object"] == "share"
    invite_code = share.pop("invite_code")
    assert invite_code.startswith("dki-")  # shown once, here
    assert {k: v for k, v in share.items() if k not in ("id", "created_at")} == {
        "object": "share", "grantee_email": grantee.email, "machines": [machine], "daily_request_limit": 200,
        "daily_token_limit": 100_000, "input_price": 20_000, "output_price": 80_000,
        "expires_at": expires.isoformat().replace("+00:00", "Z"), "status": "pending"}
    assert abs(share["created_at"] - time.time()) < 60
    assert _lists(api, owner) == {"given": [share], "received": []}
    assert _lists(api, grantee) == {"given": [], "received": []}  # nobody proved they are the grantee yet
    _redeem(api, grantee, {"invite_code": invite_code})
    received = _lists(api, grantee)
    assert received["given"] == []
    assert received["received"] == [{**share, "status": "accepted", "owner_email": owner.email,
                                     "machine_names": {machine: received["received"][0]["machine_names"][machine]}}]
    assert _lists(api, owner)["given"] == [{**share, "status": "accepted"}]


def test_defaults_all_machines_free_no_limits(api: Api) -> None:
    owner = api.signup()
    share = _share(api, owner, email=unique_email())
    assert (share["machines"], share["input_price"], share["output_price"], share["daily_request_limit"],
            share["daily_token_limit"], share["expires_at"]) == ("all", 0, 0, None, None, None)


def test_an_email_without_an_account_gets_the_same_answer_and_the_share_waits_for_the_sign_up(api: Api) -> None:
    owner, existing = api.signup(), api.signup()
    newcomer = unique_email()
    to_existing = _share(api, owner, email=existing.email, daily_request_limit=5)
    to_newcomer = _share(api, owner, email=newcomer, daily_request_limit=5)
    assert set(to_existing) == set(to_newcomer)
    different = ("id", "created_at", "grantee_email", "invite_code")
    assert {k: v for k, v in to_existing.items() if k not in different} == \
        {k: v for k, v in to_newcomer.items() if k not in different}
    joined = api.signup(email=newcomer)
    assert _lists(api, joined)["received"] == []  # an address nobody proved cannot take a share
    _redeem(api, joined, to_newcomer)
    assert [(s["id"], s["status"]) for s in _lists(api, joined)["received"]] == [(to_newcomer["id"], "accepted")]


def test_sharing_with_oneself_is_refused(api: Api) -> None:
    owner = api.signup()
    error = assert_error(api.post("/v1/shares", json={"email": owner.email.upper()}, headers=owner.auth),
                         400, "invalid_request_error")
    assert error["param"] == "email"
    assert _lists(api, owner)["given"] == []


def test_a_machine_the_owner_does_not_own_is_not_found(api: Api) -> None:
    owner, other = api.signup(), api.signup()
    mine = api.link_machine(owner)["machine_id"]
    theirs = api.link_machine(other)["machine_id"]
    for machines in ([theirs], [mine, theirs], ["mach_doesnotexist"], ["../etc"]):
        assert_error(api.post("/v1/shares", json={"email": unique_email(), "machines": machines},
                              headers=owner.auth), 404, "machine_not_found")
    assert _lists(api, owner)["given"] == []


def test_an_unlinked_machine_cannot_be_shared(api: Api) -> None:
    owner = api.signup()
    machine = api.link_machine(owner)["machine_id"]
    assert api.delete(f"/v1/me/providers/{machine}", headers=owner.auth).status_code == 200
    assert_error(api.post("/v1/shares", json={"email": unique_email(), "machines": [machine]}, headers=owner.auth),
                 404, "machine_not_found")


def test_restricted_keys_and_device_tokens_cannot_share(api: Api) -> None:
    owner = api.signup()
    restricted = api.create_key(owner, self_route_only=True)["key"]
    assert_error(api.post("/v1/shares", json={"email": unique_email()}, headers=bearer(restricted)),
                 403, "key_restricted")
    device = api.link_machine(owner)["token"]
    assert_error(api.post("/v1/shares", json={"email": unique_email()}, headers=bearer(device)), 403, "forbidden")
    unrestricted = api.create_key(owner)["key"]
    assert api.post("/v1/shares", json={"email": unique_email()}, headers=bearer(unrestricted)).status_code == 201
    assert api.get("/v1/shares", headers=bearer(device)).status_code == 200  # a read


@pytest.mark.parametrize("body, param", [
    ({}, "email"),
    ({"email": "not-an-email"}, "email"),
    ({"email": 7}, "email"),
    ({"email": "a@b.co", "color": "red"}, "color"),
    ({"email": "a@b.co", "machines": []}, "machines"),
    ({"email": "a@b.co", "machines": "everything"}, "machines"),
    ({"email": "a@b.co", "machines": [3]}, "machines"),
    ({"email": "a@b.co", "daily_request_limit": 0}, "daily_request_limit"),
    ({"email": "a@b.co", "daily_request_limit": True}, "daily_request_limit"),
    ({"email": "a@b.co", "daily_token_limit": -5}, "daily_token_limit"),
    ({"email": "a@b.co", "daily_token_limit": 1.5}, "daily_token_limit"),
    ({"email": "a@b.co", "input_price": -1}, "input_price"),
    ({"email": "a@b.co", "output_price": None}, "output_price"),
    ({"email": "a@b.co", "output_price": 10**13}, "output_price"),
    ({"email": "a@b.co", "expires_at": "next week"}, "expires_at"),
    ({"email": "a@b.co", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ({"email": "a@b.co", "expires_at": 1893456000}, "expires_at"),
])
def test_bad_share_fields_are_named(api: Api, shared_account: Account, body: dict[str, Any], param: str) -> None:
    error = assert_error(api.post("/v1/shares", json=body, headers=shared_account.auth), 400, "invalid_request_error")
    assert error["param"] == param


def test_owner_or_grantee_may_revoke_nobody_else(api: Api) -> None:
    owner, grantee, stranger = api.signup(), api.signup(), api.signup()
    first = _share(api, owner, email=grantee.email)
    second = _share(api, owner, email=grantee.email)
    _redeem(api, grantee, first)
    assert_error(api.delete(f"/v1/shares/{first['id']}", headers=stranger.auth), 404, "share_not_found")
    assert_error(api.delete("/v1/shares/shr_doesnotexist", headers=owner.auth), 404, "share_not_found")
    assert api.delete(f"/v1/shares/{first['id']}", headers=grantee.auth).status_code == 204
    assert api.delete(f"/v1/shares/{second['id']}", headers=owner.auth).status_code == 204
    assert_error(api.delete(f"/v1/shares/{first['id']}", headers=owner.auth), 404, "share_not_found")
    assert _lists(api, owner)["given"] == [] and _lists(api, grantee)["received"] == []


def test_usage_is_read_by_owner_and_grantee_only(api: Api) -> None:
    owner, grantee, stranger = api.signup(), api.signup(), api.signup()
    share = _share(api, owner, email=grantee.email)
    _redeem(api, grantee, share)
    for reader in (owner, grantee):
        resp = api.get(f"/v1/shares/{share['id']}/usage", headers=reader.auth)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"share_id": share["id"], "data": [],
                               "today": {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}}
    assert_error(api.get(f"/v1/shares/{share['id']}/usage", headers=stranger.auth), 404, "share_not_found")
