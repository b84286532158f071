"""Real coordinator processes shared by a test module, on SQLite and on a fresh Postgres database."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import pytest

from tests.support.databases import database_for
from tests.support.processes import Coordinator, start_coordinator


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def coord(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """One real coordinator process per module and backend."""
    home = tmp_path_factory.mktemp("coordinator")
    with database_for(request.param, home) as url:
        process = start_coordinator(home / "home", url)
        try:
            yield process
        finally:
            process.stop()


@dataclass
class Account:
    account_id: str
    email: str
    password: str
    token: str  # console session (dks-…)

    @property
    def auth(self) -> dict[str, str]:
        return bearer(self.token)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def unique_email() -> str:
    return f"user-{uuid.uuid4().hex[:12]}@example.com"


class Api:
    """A small httpx client for one coordinator, with helpers for the common set-up steps."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.http = httpx.Client(base_url=coordinator.base_url, timeout=30)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.put(path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.patch(path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.delete(path, **kwargs)

    def signup(self, email: str | None = None, password: str = "correct horse battery") -> Account:
        email = email or unique_email()
        resp = self.post("/v1/auth/signup", json={"email": email, "password": password})
        assert resp.status_code == 201, resp.text
        body = resp.json()
        return Account(body["account_id"], email, password, body["token"])

    def create_key(self, account: Account, **fields: Any) -> dict[str, Any]:
        resp = self.post("/v1/keys", json={"name": "test key", **fields}, headers=account.auth)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def link_machine(self, account: Account) -> dict[str, Any]:
        """The device flow end to end: a ``dkp-`` token and the ``mach_`` id it links."""
        code = self.post("/v1/device/code").json()
        approved = self.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=account.auth)
        assert approved.status_code == 200, approved.text
        token = self.post("/v1/device/token", json={"device_code": code["device_code"]})
        assert token.status_code == 200, token.text
        return token.json()

    def credit(self, account: Account, amount: int, reference: str | None = None) -> httpx.Response:
        return self.post("/v1/admin/credit", headers=self.coordinator.admin(),
                         json={"account_id": account.account_id, "amount_micro_usd": amount,
                               "reference": reference or uuid.uuid4().hex})


@pytest.fixture(scope="module")
def api(coord: Coordinator) -> Iterator[Api]:
    client = Api(coord)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def shared_account(api: Api) -> Account:
    """One account for the tests of a module that only need *an* account (saves an Argon2 hash each)."""
    return api.signup()


def assert_error(resp: httpx.Response, status: int, type_: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope with this status, type and code (``code == type`` unless given)."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert error["type"] == type_, error
    assert error["code"] == (code if code is not None else type_), error
    assert error["param"] is None or isinstance(error["param"], str)
    return error
