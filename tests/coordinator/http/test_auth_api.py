"""Sign-up, log-in, log-out and who may call what (docs/api.md "Accounts", "Who may change the account")."""

from __future__ import annotations

import pytest

from tests.coordinator.http.conftest import Api, assert_error, bearer, unique_email


def test_signup_returns_account_and_session(api: Api) -> None:
    resp = api.post("/v1/auth/signup", json={"email": unique_email(), "password": "longenough"})
    assert resp.status_code == 201
    body = resp.json()
    assert set(body) == {"account_id", "token"}
    assert body["account_id"].startswith("acct_")
    assert body["token"].startswith("dks-") and len(body["token"]) >= 4 + 43  # ≥ 32 bytes, base64url
    balance = api.get("/v1/payments/balance", headers=bearer(body["token"]))
    assert balance.status_code == 200
    assert balance.json() == {"balance_micro_usd": 0, "withdrawable_micro_usd": 0}


def test_duplicate_email_is_409_email_taken(api: Api) -> None:
    email = unique_email()
    api.signup(email)
    assert_error(api.post("/v1/auth/signup", json={"email": email, "password": "another-password"}),
                 409, "email_taken")
    # emails compare case-insensitively and trimmed
    assert_error(api.post("/v1/auth/signup", json={"email": f"  {email.upper()} ", "password": "another-password"}),
                 409, "email_taken")


@pytest.mark.parametrize("body, param", [
    ({"email": "not-an-email", "password": "longenough"}, "email"),
    ({"email": "a@b", "password": "longenough"}, "email"),
    ({"email": 42, "password": "longenough"}, "email"),
    ({"password": "longenough"}, "email"),
    ({"email": "ok@example.com", "password": "short"}, "password"),
    ({"email": "ok@example.com", "password": 12345678}, "password"),
    ({"email": "ok@example.com"}, "password"),
])
def test_bad_signup_is_400(api: Api, body: dict, param: str) -> None:
    error = assert_error(api.post("/v1/auth/signup", json=body), 400, "invalid_request_error")
    assert error["param"] == param


def test_login_returns_a_new_session(api: Api) -> None:
    account = api.signup()
    resp = api.post("/v1/auth/login", json={"email": account.email.upper(), "password": account.password})
    assert resp.status_code == 200
    body = resp.json()
    assert body["account_id"] == account.account_id
    assert body["token"].startswith("dks-") and body["token"] != account.token
    assert api.get("/v1/payments/balance", headers=bearer(body["token"])).status_code == 200


@pytest.mark.parametrize("wrong", ["password", "email", "types"])
def test_bad_login_is_401_invalid_credentials(api: Api, wrong: str) -> None:
    account = api.signup()
    body: dict[str, object] = {"email": account.email, "password": account.password}
    if wrong == "password":
        body["password"] = account.password + "x"
    elif wrong == "email":
        body["email"] = unique_email()
    else:
        body = {"email": ["x"], "password": None}
    assert_error(api.post("/v1/auth/login", json=body), 401, "invalid_credentials")


def test_logout_ends_the_session_only(api: Api) -> None:
    account = api.signup()
    second = api.post("/v1/auth/login", json={"email": account.email, "password": account.password}).json()["token"]
    resp = api.post("/v1/auth/logout", headers=account.auth)
    assert resp.status_code == 200
    assert_error(api.get("/v1/payments/balance", headers=account.auth), 401, "invalid_api_key")
    assert api.get("/v1/payments/balance", headers=bearer(second)).status_code == 200


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer"},
    {"Authorization": "Basic dXNlcjpwYXNz"},
    {"Authorization": "Bearer dk-not-a-real-key"},
    {"Authorization": "Bearer dks-not-a-real-session"},
    {"Authorization": "Bearer dkp-not-a-real-device-token"},
    {"Authorization": "Bearer something-else"},
])
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/payments/balance"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/me/providers"),
])
def test_missing_or_bad_bearer_is_401_invalid_api_key(api: Api, headers: dict, method: str, path: str) -> None:
    resp = api.request(method, path, headers=headers,
                       json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}
                       if method == "POST" else None)
    assert_error(resp, 401, "invalid_api_key")
    assert resp.headers.get("www-authenticate") == "Bearer"


def test_api_key_acts_as_its_account(api: Api) -> None:
    account = api.signup()
    key = api.create_key(account)["key"]
    assert api.get("/v1/payments/balance", headers=bearer(key)).status_code == 200
    # key management with an API key of the same account
    created = api.post("/v1/keys", json={"name": "made with a key"}, headers=bearer(key))
    assert created.status_code == 201
    listed = api.get("/v1/keys", headers=account.auth).json()["data"]
    assert created.json()["id"] in {k["id"] for k in listed}
