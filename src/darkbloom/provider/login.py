"""`darkbloom login`: the device-code flow that links this machine to an account (docs/api.md "Device login")."""

from __future__ import annotations

import contextlib
import time
import webbrowser
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from rich.console import Console

from darkbloom import paths
from darkbloom.wire import crypto
from darkbloom.provider.config import default_toml


class LoginError(Exception):
    """The machine could not be linked; the message says why and what to do."""


@dataclass
class LoginResult:
    account_id: str
    token_path: Path


def device_login(coordinator_url: str, home: Path, *, open_browser: bool, api_key: str | None,
                 out: Console, transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> LoginResult:
    base = coordinator_url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise LoginError(f"coordinator URL {coordinator_url!r} must start with http:// or https://")
    with httpx.Client(base_url=base, timeout=15.0, transport=transport) as client:
        code = _post(client, "/v1/device/code", {})
        try:
            device_code, user_code = str(code["device_code"]), str(code["user_code"])
            verification_uri = str(code.get("verification_uri") or f"{base}/console/link")
            interval = max(0.0, float(code.get("interval", 5)))
            expires_in = float(code.get("expires_in", 900))
        except (KeyError, TypeError, ValueError):
            raise LoginError(f"{base} answered /v1/device/code without a device code; is it a Darkbloom "
                             "coordinator?") from None
        out.print(f"Your code: [bold]{user_code}[/bold]")
        out.print(f"Approve it at {verification_uri}")
        if api_key:
            _approve(client, user_code, api_key)
            out.print("Approved with DARKBLOOM_API_KEY.")
        elif open_browser:
            with contextlib.suppress(webbrowser.Error):
                webbrowser.open(verification_uri)
        out.print("Waiting for approval…")
        deadline = time.monotonic() + expires_in
        while True:
            token_reply = _poll(client, device_code)
            if token_reply is not None:
                break
            if time.monotonic() >= deadline:
                raise LoginError("the code expired before it was approved; run `darkbloom login` again")
            sleep(interval)
    token, account_id = token_reply
    token_path = paths.auth_token_path(home)
    crypto.write_private_file(token_path, token + "\n")
    config_path = paths.provider_config_path(home)
    if not config_path.exists():
        config_path.write_text(default_toml(base))
    return LoginResult(account_id=account_id, token_path=token_path)


def _approve(client: httpx.Client, user_code: str, api_key: str) -> None:
    try:
        response = client.post("/v1/device/approve", json={"user_code": user_code},
                               headers={"Authorization": f"Bearer {api_key}"})
    except httpx.HTTPError as exc:
        raise LoginError(f"cannot reach the coordinator at {client.base_url}: {exc}") from None
    if response.status_code != 200:
        raise LoginError(f"DARKBLOOM_API_KEY could not approve the code ({response.status_code}: "
                         f"{_message(response)}); check that the key belongs to this coordinator")


def _poll(client: httpx.Client, device_code: str) -> tuple[str, str] | None:
    """(token, account_id) once authorized; None while pending."""
    try:
        response = client.post("/v1/device/token", json={"device_code": device_code})
    except httpx.HTTPError as exc:
        raise LoginError(f"cannot reach the coordinator at {client.base_url}: {exc}") from None
    if response.status_code == 410:
        raise LoginError("the code expired before it was approved; run `darkbloom login` again")
    if response.status_code == 404:
        raise LoginError("the coordinator no longer knows this code (already used or invalid); "
                         "run `darkbloom login` again")
    if response.status_code != 200:
        raise LoginError(f"the coordinator refused the token request ({response.status_code}: {_message(response)})")
    data = _json(response)
    status = data.get("status")
    if status == "authorization_pending":
        return None
    if status == "authorized" and isinstance(data.get("token"), str):
        return data["token"], str(data.get("account_id") or "")
    raise LoginError(f"unexpected answer from /v1/device/token: status {status!r}")


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        response = client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise LoginError(f"cannot reach the coordinator at {client.base_url}: {exc}; "
                         "check the --coordinator URL and that the coordinator is running") from None
    if response.status_code != 200:
        raise LoginError(f"{path} failed ({response.status_code}: {_message(response)})")
    return _json(response)


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise LoginError(f"{response.request.url} did not answer with JSON; is it a Darkbloom coordinator?")
    return data


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return str(error.get("message") or error.get("code") or response.text[:200])
    except (ValueError, AttributeError):
        return response.text[:200] or response.reason_phrase
