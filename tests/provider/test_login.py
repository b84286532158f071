"""`darkbloom login` against a scripted device-code endpoint (the real flow is in tests/e2e)."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from darkbloom.provider.config import load_config
from darkbloom.provider.login import LoginError, device_login

CODE = {"device_code": "dev-123", "user_code": "ABCD-EFGH", "verification_uri": "http://coord/console/link",
        "expires_in": 900, "interval": 5}


def scripted(token_replies: list[tuple[int, dict[str, Any]]], seen: list[httpx.Request],
             approve_status: int = 200) -> httpx.MockTransport:
    replies = iter(token_replies)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/device/code":
            return httpx.Response(200, json=CODE)
        if request.url.path == "/v1/device/approve":
            if approve_status != 200:
                return httpx.Response(approve_status, json={"error": {"message": "invalid api key", "type": "x"}})
            return httpx.Response(200, json={"status": "approved"})
        status, body = next(replies)
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handler)


def quiet() -> Console:
    return Console(file=io.StringIO())


def test_headless_login_stores_the_token(home: Path) -> None:
    seen: list[httpx.Request] = []
    sleeps: list[float] = []
    transport = scripted([(200, {"status": "authorization_pending"}),
                          (200, {"status": "authorized", "token": "dkp-secret", "account_id": "acct_1"})], seen)
    result = device_login("http://coord:8080/", home, open_browser=False, api_key="dk-key", out=quiet(),
                          transport=transport, sleep=sleeps.append)
    assert result.account_id == "acct_1"
    assert result.token_path == home / "auth_token"
    assert result.token_path.read_text().strip() == "dkp-secret"
    assert stat.S_IMODE(result.token_path.stat().st_mode) == 0o600
    approve = next(r for r in seen if r.url.path == "/v1/device/approve")
    assert approve.headers["authorization"] == "Bearer dk-key"
    assert json.loads(approve.content) == {"user_code": "ABCD-EFGH"}
    polls = [json.loads(r.content) for r in seen if r.url.path == "/v1/device/token"]
    assert polls == [{"device_code": "dev-123"}] * 2
    assert sleeps == [5.0]  # waits `interval` between polls
    assert load_config(home, {}).coordinator_url == "http://coord:8080"  # provider.toml written


def test_existing_provider_toml_is_left_alone(home: Path) -> None:
    (home / "provider.toml").write_text('[coordinator]\nurl = "http://elsewhere:1"\n')
    transport = scripted([(200, {"status": "authorized", "token": "dkp-x", "account_id": "a"})], [])
    device_login("http://coord:8080", home, open_browser=False, api_key=None, out=quiet(), transport=transport,
                 sleep=lambda _: None)
    assert load_config(home, {}).coordinator_url == "http://elsewhere:1"


@pytest.mark.parametrize("replies, approve_status, needle", [
    ([(410, {"error": {"type": "expired_token"}})], 200, "expired"),
    ([(404, {"error": {"type": "invalid_grant"}})], 200, "run `darkbloom login` again"),
    ([], 401, "DARKBLOOM_API_KEY could not approve the code (401: invalid api key)"),
])
def test_failures_are_sentences(home: Path, replies: list[tuple[int, dict[str, Any]]], approve_status: int,
                                needle: str) -> None:
    transport = scripted(replies, [], approve_status)
    with pytest.raises(LoginError) as info:
        device_login("http://coord", home, open_browser=False, api_key="dk-key", out=quiet(), transport=transport,
                     sleep=lambda _: None)
    assert needle in str(info.value)
    assert not (home / "auth_token").exists()


def test_unreachable_coordinator(home: Path) -> None:
    with pytest.raises(LoginError) as info:
        device_login("http://127.0.0.1:9", home, open_browser=False, api_key=None, out=quiet())
    assert "cannot reach the coordinator" in str(info.value)
