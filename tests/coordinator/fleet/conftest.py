"""Fixtures for trust tests: an in-process coordinator whose live sessions a test can inspect, and
linked device tokens made through the public device flow."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import uvicorn

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.server import build_server
from darkbloom.coordinator.services import Services
from tests.support.accounts import Account, device_token
from tests.support.processes import ADMIN_TOKEN


@dataclass
class LiveCoordinator:
    """A real coordinator (uvicorn, real sockets, SQLite) served from a thread of the test process, so
    a test can read its live sessions. Quacks like ``tests.support.processes.Coordinator``."""

    server: uvicorn.Server
    thread: threading.Thread
    base_url: str
    settings: CoordinatorSettings
    admin_token: str = ADMIN_TOKEN

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    @property
    def services(self) -> Services:
        services: Services = self.server.config.app.state.services
        return services

    def session(self, provider_id: str) -> ProviderSession | None:
        return self.services.registry.get(provider_id)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def live_coordinator(tmp_path: Path) -> Iterator[Callable[..., LiveCoordinator]]:
    started: list[LiveCoordinator] = []

    def start(**settings_fields: Any) -> LiveCoordinator:
        settings = CoordinatorSettings(
            host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN,
            database_url=f"sqlite+aiosqlite:///{tmp_path / f'coordinator-{len(started)}.db'}", **settings_fields)
        server = build_server(settings, log_level="warning")
        listening = server.config.bind_socket()  # the port the system chose, as `--port 0` does
        settings.port = port = int(listening.getsockname()[1])
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, name=f"coordinator-{port}",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "in-process coordinator did not start"
            time.sleep(0.02)
        live = LiveCoordinator(server, thread, f"http://127.0.0.1:{port}", settings)
        started.append(live)
        return live

    try:
        yield start
    finally:
        for live in started:
            live.stop()


def link_device(coord: Any, account: Account) -> tuple[str, str]:
    """The device flow through the HTTP API: a ``dkp-`` token and the ``mach_`` id it links."""
    before = {m["id"] for m in machines(coord, account)}
    token = device_token(coord, account)
    [machine_id] = {m["id"] for m in machines(coord, account)} - before
    return token, machine_id


def machines(coord: Any, account: Account) -> list[dict[str, Any]]:
    response = httpx.get(coord.api_url + "/me/providers", headers=account.headers())
    response.raise_for_status()
    return list(response.json()["data"])


def machine(coord: Any, account: Account, machine_id: str) -> dict[str, Any]:
    [found] = [m for m in machines(coord, account) if m["id"] == machine_id]
    return found


def enroll(coord: Any, machine_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{coord.api_url}/admin/machines/{machine_id}/enroll",
                      headers=coord.admin() if headers is None else headers)

