"""Every absolute URL the coordinator shows comes from --public-url or the address it listens on,
never from the request's Host header (a forged Host must not put its name in a login command)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.accounts import create_account
from tests.support.processes import Coordinator, start_coordinator

pytestmark = pytest.mark.e2e

FORGED = {"Host": "evil.example", "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https"}
PUBLIC_URL = "https://darkbloom.example.org"
PAGES = ("/console/link", "/console/machines", "/console/keys", "/console/sharing", "/console/batches", "/console/")


@dataclass
class Served:
    coord: Coordinator
    url: str  # what every absolute URL must start with


@pytest.fixture(scope="module", params=["listen-address", "public-url"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp(request.param)
    env = {"DARKBLOOM_PUBLIC_URL": PUBLIC_URL} if request.param == "public-url" else None
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'coordinator.db'}", env=env)
    try:
        yield Served(coord, PUBLIC_URL if env else coord.base_url)
    finally:
        coord.stop()


@pytest.mark.parametrize("path", PAGES)
def test_console_pages_ignore_a_forged_host(served: Served, path: str) -> None:
    page = httpx.get(served.coord.base_url + path, headers=FORGED)
    assert page.status_code == 200, page.text
    assert "evil.example" not in page.text
    if path in ("/console/link", "/console/machines"):
        assert f"darkbloom login --coordinator {served.url}<" in page.text


def test_device_login_links_ignore_a_forged_host(served: Served) -> None:
    code = httpx.post(served.coord.api_url + "/device/code", headers=FORGED).json()
    assert code["verification_uri"] == served.url + "/console/link"
    assert code["verification_uri_complete"] == f"{served.url}/console/link?code={code['user_code']}"


@pytest.mark.parametrize("path", ["/console/keys/", "/v1/keys/", "/health/"])
def test_no_redirect_is_written_from_a_forged_host(served: Served, path: str) -> None:
    token = create_account(served.coord).headers()
    resp = httpx.get(served.coord.base_url + path, headers={**FORGED, **token})
    assert "evil.example" not in resp.headers.get("location", "") and "evil.example" not in resp.text
