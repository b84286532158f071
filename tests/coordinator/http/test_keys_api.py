"""API key management over HTTP (docs/api.md "API keys")."""

from __future__ import annotations

import time
from datetime import datetime, timezone
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
    assert error["message"] == "'self_route_only' must be a boolean."
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
    {"itpm_limit": 1000}, {"otpm_limit": 1000}, {"fallback_limit_usd": 1},
    {"expires_at": "2999-01-01T00:00:00Z"},
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
    {"fallback_limit_micro_usd": 1}, {"key_hash": "0" * 64}, {"enabled": True},
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


# the key lifecycle: expiry, disabling, rotation; the fallback budget's fields

def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_lifecycle_fields_are_shown_and_edited(api: Api) -> None:
    account = api.signup()
    created = api.create_key(account)
    assert (created["expires_at"], created["disabled"]) == (None, False)
    assert (created["fallback_limit_usd"], created["fallback_limit_micro_usd"]) == (None, None)
    assert created["fallback_limit_reset"] == "none"
    later = _iso(time.time() + 3600)
    patched = api.patch(f"/v1/keys/{created['id']}", headers=account.auth, json={
        "expires_at": later, "fallback_limit_usd": 2.5, "fallback_limit_reset": "weekly", "disabled": True})
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["expires_at"] == later and body["disabled"] is True
    assert (body["fallback_limit_usd"], body["fallback_limit_micro_usd"]) == (2.5, 2_500_000)
    assert body["fallback_limit_reset"] == "weekly"
    assert api.get(f"/v1/keys/{created['id']}", headers=account.auth).json() == body
    cleared = api.patch(f"/v1/keys/{created['id']}", headers=account.auth, json={
        "expires_at": None, "fallback_limit_usd": None, "disabled": False}).json()
    assert (cleared["expires_at"], cleared["fallback_limit_micro_usd"], cleared["disabled"]) == (None, None, False)
    # an offset is honoured, and shown back in UTC
    offset = api.create_key(account, expires_at="2999-06-01T02:00:00+02:00")
    assert offset["expires_at"] == "2999-06-01T00:00:00Z"


@pytest.mark.parametrize("body, param", [
    ({"expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),     # in the past
    ({"expires_at": "tomorrow"}, "expires_at"),
    ({"expires_at": 4_000_000_000}, "expires_at"),              # ISO-8601 only, not Unix seconds
    ({"expires_at": True}, "expires_at"),
    ({"disabled": "yes"}, "disabled"),
    ({"disabled": 1}, "disabled"),
    ({"fallback_limit_usd": -1}, "fallback_limit_usd"),
    ({"fallback_limit_usd": "5"}, "fallback_limit_usd"),
    ({"fallback_limit_usd": 0.0000001}, "fallback_limit_usd"),
    ({"fallback_limit_usd": 1e13}, "fallback_limit_usd"),
    ({"fallback_limit_reset": "hourly"}, "fallback_limit_reset"),
])
def test_bad_lifecycle_values_are_named_400s(api: Api, shared_account: Account, body: dict, param: str) -> None:
    created = api.post("/v1/keys", json={"name": "k", **body}, headers=shared_account.auth)
    error = assert_error(created, 400, "invalid_request_error")
    assert error["param"] == param and param in error["message"]
    key = api.create_key(shared_account)
    error = assert_error(api.patch(f"/v1/keys/{key['id']}", json=body, headers=shared_account.auth),
                         400, "invalid_request_error")
    assert error["param"] == param


_CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_disabled_key_is_401_key_disabled_until_enabled(api: Api) -> None:
    account = api.signup()
    key = api.create_key(account)
    assert api.get("/v1/payments/balance", headers=bearer(key["key"])).status_code == 200  # cached now
    assert api.patch(f"/v1/keys/{key['id']}", json={"disabled": True}, headers=account.auth).status_code == 200
    for resp in (api.get("/v1/payments/balance", headers=bearer(key["key"])),
                 api.post("/v1/chat/completions", json=_CHAT, headers=bearer(key["key"])),
                 api.get("/v1/keys", headers=bearer(key["key"]))):
        error = assert_error(resp, 401, "key_disabled")
        assert error["code"] == "key_disabled"
    assert api.patch(f"/v1/keys/{key['id']}", json={"disabled": False}, headers=account.auth).status_code == 200
    assert api.get("/v1/payments/balance", headers=bearer(key["key"])).status_code == 200
    born_disabled = api.create_key(account, disabled=True)
    assert born_disabled["disabled"] is True
    assert_error(api.get("/v1/models", headers=bearer(born_disabled["key"])), 401, "key_disabled")


def test_an_expired_key_is_401_key_expired(api: Api) -> None:
    account = api.signup()
    expires = int(time.time()) + 2
    key = api.create_key(account, expires_at=_iso(expires))
    assert api.get("/v1/payments/balance", headers=bearer(key["key"])).status_code == 200  # cached now
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    for resp in (api.get("/v1/payments/balance", headers=bearer(key["key"])),
                 api.post("/v1/chat/completions", json=_CHAT, headers=bearer(key["key"]))):
        error = assert_error(resp, 401, "key_expired")
        assert error["code"] == "key_expired"
    # the owner can give it a new life from a session (the key itself cannot: it is refused)
    later = _iso(time.time() + 3600)
    assert api.patch(f"/v1/keys/{key['id']}", json={"expires_at": later}, headers=account.auth).status_code == 200
    assert api.get("/v1/payments/balance", headers=bearer(key["key"])).status_code == 200


def test_rotate_gives_a_new_secret_and_refuses_the_old_one_at_once(api: Api) -> None:
    account = api.signup()
    key = api.create_key(account, name="ci", rpm_limit=50)
    old = key["key"]
    assert api.get("/v1/payments/balance", headers=bearer(old)).status_code == 200  # cached now
    resp = api.post(f"/v1/keys/{key['id']}/rotate", headers=account.auth)
    assert resp.status_code == 200, resp.text
    rotated = resp.json()
    assert rotated["id"] == key["id"] and rotated["key"].startswith("dk-") and rotated["key"] != old
    assert_error(api.get("/v1/payments/balance", headers=bearer(old)), 401, "invalid_api_key")
    assert api.get("/v1/payments/balance", headers=bearer(rotated["key"])).status_code == 200
    view = api.get(f"/v1/keys/{key['id']}", headers=account.auth).json()
    assert view["name"] == "ci" and view["rpm_limit"] == 50 and rotated["key"].startswith(view["key_prefix"])
    assert rotated["key"] not in api.get("/v1/keys", headers=account.auth).text


def test_rotate_needs_a_session_or_an_unrestricted_key_of_the_account(api: Api) -> None:
    account, other = api.signup(), api.signup()
    key = api.create_key(account)
    restricted = api.create_key(account, rpm_limit=5)
    assert_error(api.post(f"/v1/keys/{key['id']}/rotate", headers=other.auth), 404, "key_not_found")
    assert_error(api.post("/v1/keys/key_nope/rotate", headers=account.auth), 404, "key_not_found")
    assert_error(api.post(f"/v1/keys/{key['id']}/rotate", headers=bearer(restricted["key"])), 403, "key_restricted")
    assert api.get("/v1/payments/balance", headers=bearer(key["key"])).status_code == 200  # untouched
    rotated = api.post(f"/v1/keys/{key['id']}/rotate", headers=bearer(key["key"]))  # an unrestricted key, itself
    assert rotated.status_code == 200
    assert_error(api.get("/v1/payments/balance", headers=bearer(key["key"])), 401, "invalid_api_key")
    deleted = api.create_key(account)
    api.delete(f"/v1/keys/{deleted['id']}", headers=account.auth)
    assert_error(api.post(f"/v1/keys/{deleted['id']}/rotate", headers=account.auth), 404, "key_not_found")
