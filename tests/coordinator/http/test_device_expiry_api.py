"""Expired device codes over HTTP: a coordinator whose codes expire at once (``--device-code-ttl 0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.coordinator.http.conftest import Api, assert_error
from tests.support.processes import start_coordinator


@pytest.fixture(scope="module")
def expiring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    home: Path = tmp_path_factory.mktemp("expiring")
    coordinator = start_coordinator(home / "home", f"sqlite+aiosqlite:///{home / 'coordinator.db'}",
                                    "--device-code-ttl", "0")
    client = Api(coordinator)
    try:
        yield client
    finally:
        client.close()
        coordinator.stop()


def test_expired_code_cannot_be_approved_or_exchanged(expiring: Api) -> None:
    account = expiring.signup()
    code = expiring.post("/v1/device/code").json()
    assert code["expires_in"] == 0
    assert_error(expiring.post("/v1/device/approve", json={"user_code": code["user_code"]}, headers=account.auth),
                 410, "expired_code")
    assert_error(expiring.post("/v1/device/token", json={"device_code": code["device_code"]}),
                 410, "expired_token")
    assert expiring.get("/v1/me/providers", headers=account.auth).json()["data"] == []


def test_unknown_code_is_still_404_when_codes_expire(expiring: Api) -> None:
    account = expiring.signup()
    assert_error(expiring.post("/v1/device/approve", json={"user_code": "ZZZZ-ZZZZ"}, headers=account.auth),
                 404, "invalid_code")
