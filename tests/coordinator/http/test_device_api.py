"""Device login over HTTP (docs/api.md "Device login") and the linked machines it creates (docs/api.md
"Linked machines")."""

from __future__ import annotations

import re

import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error, bearer

USER_CODE = re.compile(r"^[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}-[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}$")


def test_code_has_the_rfc_8628_shape(api: Api) -> None:
    resp = api.post("/v1/device/code")
    assert resp.status_code == 200
    body = resp.json()
    assert USER_CODE.match(body["user_code"]), body["user_code"]
    assert body["expires_in"] == 900
    assert body["interval"] == 5
    assert isinstance(body["device_code"], str) and len(body["device_code"]) >= 43
    assert body["verification_uri"].startswith(api.coordinator.base_url)
    codes = {api.post("/v1/device/code").json()["user_code"] for _ in range(5)}
    assert len(codes) == 5


def test_full_flow_pending_then_token_once(api: Api) -> None:
    account = api.signup()
    code = api.post("/v1/device/code").json()

    pending = api.post("/v1/device/token", json={"device_code": code["device_code"]})
    assert pending.status_code == 200 and pending.json() == {"status": "authorization_pending"}

    approved = api.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=account.auth)
    assert approved.status_code == 200 and approved.json() == {"status": "approved"}

    issued = api.post("/v1/device/token", json={"device_code": code["device_code"]})
    assert issued.status_code == 200
    body = issued.json()
    assert body["status"] == "authorized"
    assert body["account_id"] == account.account_id
    assert body["token"].startswith("dkp-") and len(body["token"]) >= 4 + 43

    assert_error(api.post("/v1/device/token", json={"device_code": code["device_code"]}), 404, "invalid_grant")


def test_approve_accepts_lower_case_padded_code(api: Api) -> None:
    account = api.signup()
    code = api.post("/v1/device/code").json()
    resp = api.post("/v1/device/approve", json={"user_code": f"  {code['user_code'].lower()}\t"},
                    headers=account.auth)
    assert resp.status_code == 200, resp.text
    token = api.post("/v1/device/token", json={"device_code": code["device_code"]}).json()
    assert token["status"] == "authorized" and token["account_id"] == account.account_id


def test_approve_unknown_code_is_404_invalid_code(api: Api, shared_account: Account) -> None:
    assert_error(api.post("/v1/device/approve", json={"user_code": "2222-2222"}, headers=shared_account.auth),
                 404, "invalid_code")


@pytest.mark.parametrize("body", [{}, {"user_code": ""}, {"user_code": "   "}, {"user_code": 1234}])
def test_approve_without_a_code_is_400(api: Api, shared_account: Account, body: dict) -> None:
    error = assert_error(api.post("/v1/device/approve", json=body, headers=shared_account.auth),
                         400, "invalid_request_error")
    assert error["param"] == "user_code"


def test_approve_twice_is_409_already_used(api: Api) -> None:
    first, second = api.signup(), api.signup()
    code = api.post("/v1/device/code").json()
    assert api.post("/v1/device/approve", json={"user_code": code["user_code"]},
                    headers=first.auth).status_code == 200
    assert_error(api.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=second.auth),
                 409, "already_used")
    # the token still goes to the first approver
    token = api.post("/v1/device/token", json={"device_code": code["device_code"]}).json()
    assert token["account_id"] == first.account_id
    assert_error(api.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=first.auth),
                 409, "already_used")


@pytest.mark.parametrize("body", [{"device_code": "not-a-device-code"}, {"device_code": ""}, {}])
def test_token_for_unknown_device_code(api: Api, body: dict) -> None:
    resp = api.post("/v1/device/token", json=body)
    if body.get("device_code"):
        assert_error(resp, 404, "invalid_grant")
    else:
        assert_error(resp, 400, "invalid_request_error")


def test_approve_needs_an_account(api: Api) -> None:
    code = api.post("/v1/device/code").json()
    assert_error(api.post("/v1/device/approve", json={"user_code": code["user_code"]}), 401, "invalid_api_key")
    pending = api.post("/v1/device/token", json={"device_code": code["device_code"]}).json()
    assert pending == {"status": "authorization_pending"}


def test_approve_with_an_api_key(api: Api) -> None:
    account = api.signup()
    key = api.create_key(account)["key"]
    code = api.post("/v1/device/code").json()
    assert api.post("/v1/device/approve", json={"user_code": code["user_code"]},
                    headers=bearer(key)).status_code == 200
    assert api.post("/v1/device/token", json={"device_code": code["device_code"]}).json()["account_id"] == \
        account.account_id


def test_device_token_reads_the_account_but_cannot_manage_it(api: Api) -> None:
    account = api.signup()
    device = bearer(api.link_machine(account)["token"])

    balance = api.get("/v1/payments/balance", headers=device)
    assert balance.status_code == 200 and balance.json()["balance_micro_usd"] == 0
    assert api.get("/v1/me/providers", headers=device).status_code == 200

    key_id = api.create_key(account)["id"]
    assert api.get("/v1/keys", headers=device).status_code == 200  # an account read
    assert api.get(f"/v1/keys/{key_id}", headers=device).status_code == 200

    assert_error(api.post("/v1/keys", json={"name": "nope"}, headers=device), 403, "forbidden")
    assert_error(api.patch(f"/v1/keys/{key_id}", json={"name": "x"}, headers=device), 403, "forbidden")
    assert_error(api.delete(f"/v1/keys/{key_id}", headers=device), 403, "forbidden")
    code = api.post("/v1/device/code").json()
    assert_error(api.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=device),
                 403, "forbidden")
    assert api.get(f"/v1/keys/{key_id}", headers=account.auth).json()["name"] == "test key"


def test_a_device_token_cannot_unlink_the_accounts_machines(api: Api) -> None:
    account = api.signup()
    mine = api.link_machine(account)
    other = api.link_machine(account)
    for machine in (other, mine):
        resp = api.delete(f"/v1/me/providers/{machine['machine_id']}", headers=bearer(mine["token"]))
        assert_error(resp, 403, "forbidden")
    linked = [m["id"] for m in api.get("/v1/me/providers", headers=account.auth).json()["data"]]
    assert {mine["machine_id"], other["machine_id"]} <= set(linked)


def test_exchange_links_a_machine(api: Api) -> None:
    account = api.signup()
    assert api.get("/v1/me/providers", headers=account.auth).json() == \
        {"object": "list", "data": [], "next_cursor": None}
    linked = api.link_machine(account)

    resp = api.get("/v1/me/providers", headers=account.auth)
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list" and body["next_cursor"] is None
    assert len(body["data"]) == 1
    machine = body["data"][0]
    assert machine["id"].startswith("mach_")
    assert machine["session_id"] is None and machine["online"] is False
    assert machine["models"] == [] and machine["private_only"] is False
    assert (machine["device"], machine["backend"]) == (None, None)  # where it runs: known once it is online
    assert {"name", "trust_level", "last_seen"} <= set(machine)

    second = api.link_machine(account)
    ids = [m["id"] for m in api.get("/v1/me/providers", headers=account.auth).json()["data"]]
    assert len(ids) == len(set(ids)) == 2 and machine["id"] in ids
    assert second["token"] != linked["token"]


def test_unlink_removes_the_machine_and_revokes_its_token(api: Api) -> None:
    account = api.signup()
    linked = api.link_machine(account)
    [target] = [m["id"] for m in api.get("/v1/me/providers", headers=account.auth).json()["data"]]
    kept = api.link_machine(account)
    device = bearer(linked["token"])
    assert api.get("/v1/payments/balance", headers=device).status_code == 200

    resp = api.delete(f"/v1/me/providers/{target}", headers=account.auth)
    assert resp.status_code == 200 and resp.json()["deleted"] is True

    remaining = [m["id"] for m in api.get("/v1/me/providers", headers=account.auth).json()["data"]]
    assert len(remaining) == 1 and target not in remaining
    assert_error(api.get("/v1/payments/balance", headers=device), 401, "invalid_api_key")
    assert_error(api.get("/v1/me/providers", headers=device), 401, "invalid_api_key")
    assert api.get("/v1/payments/balance", headers=bearer(kept["token"])).status_code == 200
    assert_error(api.delete(f"/v1/me/providers/{target}", headers=account.auth), 404, "machine_not_found")


def test_other_account_cannot_unlink_my_machine(api: Api) -> None:
    me, other = api.signup(), api.signup()
    linked = api.link_machine(me)
    machine_id = api.get("/v1/me/providers", headers=me.auth).json()["data"][0]["id"]
    assert api.get("/v1/me/providers", headers=other.auth).json()["data"] == []
    assert_error(api.delete(f"/v1/me/providers/{machine_id}", headers=other.auth), 404, "machine_not_found")
    assert_error(api.delete("/v1/me/providers/mach_doesnotexist", headers=me.auth), 404, "machine_not_found")
    assert [m["id"] for m in api.get("/v1/me/providers", headers=me.auth).json()["data"]] == [machine_id]
    assert api.get("/v1/payments/balance", headers=bearer(linked["token"])).status_code == 200
