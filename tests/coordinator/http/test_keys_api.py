"""API key management over HTTP (docs/api.md "API keys")."""

from __future__ import annotations

from typing import Any

import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error, bearer


def test_create_shows_the_secret_once(api: Api) -> None:
    account = api.signup()
    resp = api.post("/v1/keys", json={"name": "  laptop  "}, headers=account.auth)
    assert resp.status_code == 201
    created = resp.json()
    secret = created["key"]
    assert secret.startswith("dk-") and len(secret) >= 3 + 43
    assert created["id"].startswith("key_")
    assert created["name"] == "laptop"
    assert created["self_route_only"] is False
    assert created["limit_usd"] is None and created["limit_micro_usd"] is None
    assert created["limit_reset"] == "none"
    assert secret.startswith(created["key_prefix"])

    one = api.get(f"/v1/keys/{created['id']}", headers=account.auth)
    listed = api.get("/v1/keys", headers=account.auth)
    assert one.status_code == 200 and listed.status_code == 200
    assert "key" not in one.json()
    assert one.json() == {k: v for k, v in created.items() if k != "key"}
    assert listed.json()["object"] == "list"
    assert [k["id"] for k in listed.json()["data"]] == [created["id"]]
    for resp in (one, listed):
        assert secret not in resp.text
        assert secret[len(created["key_prefix"]):] not in resp.text


def test_list_never_shows_secrets(api: Api) -> None:
    account = api.signup()
    secrets = [api.create_key(account, name=f"k{i}")["key"] for i in range(3)]
    resp = api.get("/v1/keys", headers=account.auth)
    assert resp.status_code == 200
    for row in resp.json()["data"]:
        assert "key" not in row and "key_hash" not in row
    for secret in secrets:
        assert secret not in resp.text


def test_list_paginates_with_a_cursor(api: Api) -> None:
    account = api.signup()
    created = {api.create_key(account, name=f"k{i}")["id"] for i in range(5)}
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        body = api.get("/v1/keys", params=params, headers=account.auth).json()
        pages += 1
        assert body["object"] == "list" and len(body["data"]) <= 2
        seen.extend(k["id"] for k in body["data"])
        cursor = body["next_cursor"]
        if cursor is None:
            break
        assert cursor == body["data"][-1]["id"]
        assert pages < 10
    assert pages == 3
    assert len(seen) == len(set(seen)) == 5 and set(seen) == created

    whole = api.get("/v1/keys", params={"limit": 5}, headers=account.auth).json()
    assert len(whole["data"]) == 5 and whole["next_cursor"] is None


@pytest.mark.parametrize("limit", [0, -1, 1001, "many"])
def test_list_rejects_a_bad_limit(api: Api, shared_account: Account, limit: object) -> None:
    assert_error(api.get("/v1/keys", params={"limit": limit}, headers=shared_account.auth),
                 400, "invalid_request_error")


def test_create_with_every_field(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account, name="full", self_route_only=True, limit_usd=12.5, limit_reset="monthly",
                             rpm_limit=60, itpm_limit=10_000, otpm_limit=5_000,
                             allowed_models=["smollm2-135m", "b", "smollm2-135m"])
    assert created["self_route_only"] is True
    assert created["limit_micro_usd"] == 12_500_000 and created["limit_usd"] == 12.5
    assert created["limit_reset"] == "monthly"
    assert (created["rpm_limit"], created["itpm_limit"], created["otpm_limit"]) == (60, 10_000, 5_000)
    assert created["allowed_models"] == ["b", "smollm2-135m"]


@pytest.mark.parametrize("limit_usd, micro", [
    (1, 1_000_000), (0, 0), (0.000001, 1), (2.75, 2_750_000), (0.1, 100_000), (1234.567891, 1_234_567_891),
])
def test_limit_usd_is_stored_as_micro_usd(api: Api, shared_account: Account, limit_usd: float, micro: int) -> None:
    account = shared_account
    created = api.create_key(account, limit_usd=limit_usd)
    assert created["limit_micro_usd"] == micro
    assert isinstance(created["limit_micro_usd"], int)
    patched = api.patch(f"/v1/keys/{created['id']}", json={"limit_usd": None}, headers=account.auth).json()
    assert patched["limit_micro_usd"] is None
    patched = api.patch(f"/v1/keys/{created['id']}", json={"limit_usd": limit_usd}, headers=account.auth).json()
    assert patched["limit_micro_usd"] == micro


@pytest.mark.parametrize("body, param", [
    ({}, "name"),
    ({"name": ""}, "name"),
    ({"name": "   "}, "name"),
    ({"name": 5}, "name"),
    ({"name": "x" * 201}, "name"),
    ({"name": "k", "limit_usd": -1}, "limit_usd"),
    ({"name": "k", "limit_usd": 0.0000001}, "limit_usd"),
    ({"name": "k", "limit_usd": "5"}, "limit_usd"),
    ({"name": "k", "limit_usd": True}, "limit_usd"),
    ({"name": "k", "limit_reset": "hourly"}, "limit_reset"),
    ({"name": "k", "limit_usd": 1e13}, "limit_usd"),            # 1e19 µUSD does not fit a BIGINT
    ({"name": "k", "limit_usd": 10**30}, "limit_usd"),
    ({"name": "k", "rpm_limit": 0}, "rpm_limit"),
    ({"name": "k", "rpm_limit": 2**31}, "rpm_limit"),           # does not fit an INTEGER
    ({"name": "k", "otpm_limit": 2**63}, "otpm_limit"),
    ({"name": "k", "itpm_limit": 1.5}, "itpm_limit"),
    ({"name": "k", "otpm_limit": True}, "otpm_limit"),
    ({"name": "k", "allowed_models": "smollm2-135m"}, "allowed_models"),
    ({"name": "k", "allowed_models": [""]}, "allowed_models"),
    ({"name": "k", "self_route_only": "yes"}, "self_route_only"),
])
def test_bad_create_is_400(api: Api, shared_account: Account, body: dict, param: str) -> None:
    before = api.get("/v1/keys", params={"limit": 1000}, headers=shared_account.auth).json()["data"]
    error = assert_error(api.post("/v1/keys", json=body, headers=shared_account.auth), 400, "invalid_request_error")
    assert error["param"] == param
    assert api.get("/v1/keys", params={"limit": 1000}, headers=shared_account.auth).json()["data"] == before


@pytest.mark.parametrize("raw,param", [
    (b'{"name": "k", "limit_usd": NaN}', None), (b'{"name": "k", "limit_usd": Infinity}', None),
    (b'{"name": "k", "limit_usd": -Infinity}', None),  # not JSON at all: refused by the body reader
    (b'{"name": "k", "limit_usd": 1e400}', "limit_usd"),  # JSON, but no finite number
])
def test_non_finite_limit_is_400(api: Api, shared_account: Account, raw: bytes, param: str | None) -> None:
    resp = api.post("/v1/keys", content=raw, headers={**shared_account.auth, "Content-Type": "application/json"})
    assert assert_error(resp, 400, "invalid_request_error")["param"] == param


def test_largest_limits_are_stored_exactly(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account, limit_usd=9_223_372_036_854, rpm_limit=2**31 - 1, itpm_limit=2**31 - 1)
    assert created["limit_micro_usd"] == 9_223_372_036_854_000_000
    assert created["rpm_limit"] == created["itpm_limit"] == 2**31 - 1
    again = api.get(f"/v1/keys/{created['id']}", headers=account.auth).json()
    assert again["limit_micro_usd"] == 9_223_372_036_854_000_000 and again["rpm_limit"] == 2**31 - 1


def test_patch_changes_only_given_fields(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account, name="before", rpm_limit=10)
    resp = api.patch(f"/v1/keys/{created['id']}", json={"self_route_only": True, "name": "after"},
                     headers=account.auth)
    assert resp.status_code == 200
    body = resp.json()
    assert (body["name"], body["self_route_only"], body["rpm_limit"]) == ("after", True, 10)
    assert "key" not in body
    again = api.get(f"/v1/keys/{created['id']}", headers=account.auth).json()
    assert again == body
    off = api.patch(f"/v1/keys/{created['id']}", json={"self_route_only": False}, headers=account.auth).json()
    assert off["self_route_only"] is False and off["name"] == "after"


@pytest.mark.parametrize("value", ["true", 1, 0, None, "false", [], {}])
def test_patch_non_boolean_self_route_only_is_400(api: Api, shared_account: Account, value: object) -> None:
    account = shared_account
    created = api.create_key(account, self_route_only=True)
    resp = api.patch(f"/v1/keys/{created['id']}", json={"self_route_only": value}, headers=account.auth)
    error = assert_error(resp, 400, "invalid_request_error")
    assert error["message"] == "invalid value for self_route_only"
    assert error["param"] == "self_route_only"
    assert api.get(f"/v1/keys/{created['id']}", headers=account.auth).json()["self_route_only"] is True


def test_other_account_cannot_touch_my_key(api: Api) -> None:
    me, other = api.signup(), api.signup()
    mine = api.create_key(me, name="mine")
    other_key = api.create_key(other)["key"]
    for headers in (other.auth, bearer(other_key)):
        assert_error(api.get(f"/v1/keys/{mine['id']}", headers=headers), 404, "key_not_found")
        assert_error(api.patch(f"/v1/keys/{mine['id']}", json={"name": "stolen"}, headers=headers),
                     404, "key_not_found")
        assert_error(api.delete(f"/v1/keys/{mine['id']}", headers=headers), 404, "key_not_found")
        listed = api.get("/v1/keys", headers=headers).json()["data"]
        assert mine["id"] not in {k["id"] for k in listed}
    still = api.get(f"/v1/keys/{mine['id']}", headers=me.auth)
    assert still.status_code == 200 and still.json()["name"] == "mine"
    assert api.get("/v1/payments/balance", headers=bearer(mine["key"])).status_code == 200


def test_deleted_key_no_longer_authenticates(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account)
    assert api.get("/v1/payments/balance", headers=bearer(created["key"])).status_code == 200
    resp = api.delete(f"/v1/keys/{created['id']}", headers=account.auth)
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    assert_error(api.get("/v1/payments/balance", headers=bearer(created["key"])), 401, "invalid_api_key")
    assert_error(api.post("/v1/chat/completions", headers=bearer(created["key"]),
                          json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}),
                 401, "invalid_api_key")
    assert_error(api.get(f"/v1/keys/{created['id']}", headers=account.auth), 404, "key_not_found")
    assert_error(api.delete(f"/v1/keys/{created['id']}", headers=account.auth), 404, "key_not_found")
    assert api.get("/v1/keys", headers=account.auth).json()["data"] == []


def test_a_key_can_delete_itself(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account)
    assert api.delete(f"/v1/keys/{created['id']}", headers=bearer(created["key"])).status_code == 200
    assert_error(api.get("/v1/keys", headers=bearer(created["key"])), 401, "invalid_api_key")


@pytest.mark.parametrize("restriction", [
    {"self_route_only": True}, {"limit_usd": 0.001}, {"allowed_models": ["smollm2-135m"]}, {"rpm_limit": 5},
    {"itpm_limit": 1000}, {"otpm_limit": 1000},
])
def test_a_restricted_key_can_never_widen_itself_or_mint_another(api: Api, restriction: dict[str, Any]) -> None:
    account = api.signup()
    leaked = api.create_key(account, **restriction)
    as_leaked = bearer(leaked["key"])
    widen = api.patch(f"/v1/keys/{leaked['id']}", headers=as_leaked,
                      json={"self_route_only": False, "limit_usd": None, "allowed_models": None, "rpm_limit": None})
    assert_error(widen, 403, "key_restricted")
    assert_error(api.post("/v1/keys", json={"name": "unrestricted"}, headers=as_leaked), 403, "key_restricted")
    other = api.create_key(account)
    assert_error(api.delete(f"/v1/keys/{other['id']}", headers=as_leaked), 403, "key_restricted")
    code = api.post("/v1/device/code").json()
    assert_error(api.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=as_leaked),
                 403, "key_restricted")
    # unchanged, and still readable by the key itself
    again = api.get(f"/v1/keys/{leaked['id']}", headers=as_leaked)
    assert again.status_code == 200
    assert {k: again.json()[k] for k in ("self_route_only", "limit_micro_usd", "allowed_models", "rpm_limit")} == \
        {k: leaked[k] for k in ("self_route_only", "limit_micro_usd", "allowed_models", "rpm_limit")}
    assert len(api.get("/v1/keys", headers=account.auth).json()["data"]) == 2


def test_an_unrestricted_key_manages_keys(api: Api) -> None:
    account = api.signup()
    admin_key = bearer(api.create_key(account)["key"])
    created = api.post("/v1/keys", json={"name": "child", "self_route_only": True}, headers=admin_key)
    assert created.status_code == 201
    assert api.delete(f"/v1/keys/{created.json()['id']}", headers=admin_key).status_code == 200


@pytest.mark.parametrize("unknown", [
    {"limit_micro_usd": 1000},                      # the view's own field, not an input
    {"key": "dk-mine"}, {"id": "key_x"},
    {"fallback_limit_usd": 1}, {"expires_at": 2_000_000_000}, {"disabled": True},
])
def test_an_unknown_key_field_is_400_naming_it_on_create_and_edit(api: Api, shared_account: Account,
                                                                  unknown: dict[str, Any]) -> None:
    [name] = unknown
    created = api.post("/v1/keys", json={"name": "k", **unknown}, headers=shared_account.auth)
    error = assert_error(created, 400, "invalid_request_error")
    assert error["param"] == name and f"'{name}'" in error["message"]
    key = api.create_key(shared_account)
    edited = api.patch(f"/v1/keys/{key['id']}", json={"rpm_limit": 5, **unknown}, headers=shared_account.auth)
    error = assert_error(edited, 400, "invalid_request_error")
    assert error["param"] == name and f"'{name}'" in error["message"]
    assert api.get(f"/v1/keys/{key['id']}", headers=shared_account.auth).json() == {
        k: v for k, v in key.items() if k != "key"}  # the refused edit changed nothing


def test_every_unknown_key_field_is_named(api: Api, shared_account: Account) -> None:
    resp = api.post("/v1/keys", json={"name": "k", "limit_micro_usd": 1, "spend_cap": 2},
                    headers=shared_account.auth)
    error = assert_error(resp, 400, "invalid_request_error")
    assert "'limit_micro_usd'" in error["message"] and "'spend_cap'" in error["message"]
    assert error["param"] == "limit_micro_usd"


def test_shared_only_is_a_boolean_and_restricts_the_key(api: Api) -> None:
    account = api.signup()
    key = api.create_key(account, shared_only=True)
    assert key["shared_only"] is True and key["self_route_only"] is False
    error = assert_error(api.patch(f"/v1/keys/{key['id']}", json={"shared_only": "yes"}, headers=account.auth),
                         400, "invalid_request_error")
    assert error["param"] == "shared_only"
    assert_error(api.post("/v1/keys", json={"name": "wider"}, headers=bearer(key["key"])), 403, "key_restricted")
    edited = api.patch(f"/v1/keys/{key['id']}", json={"shared_only": False}, headers=account.auth)
    assert edited.status_code == 200 and edited.json()["shared_only"] is False
