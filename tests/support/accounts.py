"""Accounts, keys and linked nodes made through the public HTTP API, as a user would."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tests.support.processes import Coordinator, Process, darkbloom_cmd, spawn, wait_until, _env


class Reachable(Protocol):
    """A coordinator as these helpers reach it: a process (``Coordinator``), one in-process, a replica."""

    @property
    def api_url(self) -> str: ...


@dataclass
class Account:
    account_id: str
    session: str
    api_key: str
    email: str

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.api_key}"}


def create_account(coord: Coordinator, credit_micro_usd: int = 0, **key_fields: object) -> Account:
    email = f"user-{secrets.token_hex(4)}@example.com"
    signup = httpx.post(coord.api_url + "/auth/signup", json={"email": email, "password": "correct horse 1"})
    signup.raise_for_status()
    body = signup.json()
    key = httpx.post(coord.api_url + "/keys", json={"name": "test", **key_fields},
                     headers={"Authorization": f"Bearer {body['token']}"})
    key.raise_for_status()
    if credit_micro_usd:
        httpx.post(coord.api_url + "/admin/credit", headers=coord.admin(), json={
            "account_id": body["account_id"], "amount_micro_usd": credit_micro_usd,
            "reference": "test-" + secrets.token_hex(6)}).raise_for_status()
    return Account(body["account_id"], body["token"], key.json()["key"], email)


def device_token(coord: Reachable, account: Account) -> str:
    """What `darkbloom login` does, over HTTP: a `dkp-` device token for a new machine of the account."""
    code = httpx.post(coord.api_url + "/device/code").json()
    approved = httpx.post(coord.api_url + "/device/approve", json={"user_code": code["user_code"]},
                          headers=account.headers(account.session))
    assert approved.status_code == 200, approved.text
    token = httpx.post(coord.api_url + "/device/token", json={"device_code": code["device_code"]}).json()
    assert token["status"] == "authorized", token
    return str(token["token"])


def balance(coord: Reachable, account: Account) -> int:
    """The account's balance in µUSD, read with its API key."""
    response = httpx.get(coord.api_url + "/payments/balance", headers=account.headers(), timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["balance_micro_usd"])


def login_node(coord: Coordinator, home: Path, account: Account) -> str:
    """`darkbloom login` on the headless path (DARKBLOOM_API_KEY); returns the device token."""
    result = subprocess.run(darkbloom_cmd("login", "--coordinator", coord.base_url, "--no-browser"),
                            env=_env(home, {"DARKBLOOM_API_KEY": account.api_key}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return (home / "auth_token").read_text().strip()


def start_node(coord: Coordinator, home: Path, *args: str) -> Process:
    return spawn(darkbloom_cmd("serve", "--coordinator", coord.base_url, *args), home, "node.log")


def online_sessions(coord: Coordinator, account: Account) -> list[dict[str, object]]:
    listing = httpx.get(coord.api_url + "/me/providers", headers=account.headers())
    listing.raise_for_status()
    return [m for m in listing.json()["data"] if m["online"]]


def wait_online(coord: Coordinator, account: Account, count: int = 1, timeout: float = 120) -> list[dict[str, object]]:
    return wait_until(lambda: (s := online_sessions(coord, account)) and len(s) >= count and s,
                      timeout=timeout, interval=0.2, what=f"{count} machine(s) online")


def wait_model_listed(coord: Coordinator, account: Account, model: str = "smollm2-135m",
                      timeout: float = 120) -> None:
    def listed() -> bool:
        response = httpx.get(coord.api_url + "/models", headers=account.headers())
        return any(m["id"] == model for m in response.json().get("data", []))
    wait_until(listed, timeout=timeout, interval=0.2, what=f"{model} listed")
