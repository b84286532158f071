"""Password hashing: its cost is configurable above a floor and kept in each hash; it never runs on the
event loop's default executor (a flood of log-ins waits for the few threads of its own, and work
others put on the default executor is not held up by it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from argon2.exceptions import VerifyMismatchError

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.identity import console_login

PASSWORD = "correct horse battery"


class RecordingExecutor(ThreadPoolExecutor):
    """The loop's default executor, remembering every callable it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=8)
        self.given: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.given.append(repr((fn, args)))
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
async def http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    """The coordinator app in this test's event loop, so the loop's default executor is the test's."""
    for name in ("LOGIN_FAILURES_PER_EMAIL", "LOGIN_FAILURES_PER_ADDRESS", "SIGNUPS_PER_ADDRESS"):
        monkeypatch.setenv(f"DARKBLOOM_{name}", "1000")
    app = create_app(CoordinatorSettings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as client:
            assert (await client.post("/v1/auth/signup", json={"email": "ada@example.com", "password": PASSWORD})
                    ).status_code == 201
            yield client


async def _attempt(http: httpx.AsyncClient, email: str, password: str) -> int:
    return (await http.post("/v1/auth/login", json={"email": email, "password": password})).status_code


async def test_argon2_never_runs_on_the_default_executor(http: httpx.AsyncClient) -> None:
    recording = RecordingExecutor()
    asyncio.get_running_loop().set_default_executor(recording)
    signup = await http.post("/v1/auth/signup", json={"email": "bob@example.com", "password": PASSWORD})
    outcomes = await asyncio.gather(*(_attempt(http, email, password) for email, password in (
        ("ada@example.com", PASSWORD), ("ada@example.com", "wrong password"), ("nobody@example.com", PASSWORD))))
    assert signup.status_code == 201 and outcomes == [200, 401, 401]
    assert not [call for call in recording.given if "argon2" in call.lower() or "PasswordHasher" in call]


class HeldHasher:
    """Argon2 for a flood of wrong guesses: every check waits until ``release`` is set, then fails
    (as the real one would), so the flood holds every hashing thread for as long as a test needs."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.release = threading.Event()
        self.entered = 0

    def hash(self, password: str) -> str:
        return str(self.real.hash(password))

    def verify(self, password_hash: str, password: str) -> bool:
        self.entered += 1
        self.release.wait(120)
        raise VerifyMismatchError()


async def test_fifty_log_ins_at_once_leave_the_default_executor_free(http: httpx.AsyncClient,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=4))
    held = HeldHasher(console_login._hasher_of(19_456, 2))
    monkeypatch.setattr(console_login, "_hasher", lambda services: held)
    hashing = asyncio.gather(*(_attempt(http, "ada@example.com", f"guess {i}") for i in range(50)))
    try:
        while held.entered < console_login.HASH_THREADS:  # every hashing thread holds a log-in, the rest queue
            await asyncio.sleep(0.01)
        # what a DNS lookup or to_thread would wait for: it runs while the whole flood is still held
        job = loop.run_in_executor(None, lambda: not held.release.is_set())
        done, _ = await asyncio.wait({job}, timeout=60)  # bounds only a failure: a held default executor
        hash_threads = [t for t in threading.enumerate() if t.name.startswith("argon2")]
    finally:
        held.release.set()
    assert await hashing == [401] * 50
    assert job in done and job.result(), "the default executor waited for the log-ins"
    assert 1 <= len(hash_threads) <= console_login.HASH_THREADS


async def _stored_hash(database_url: str, email: str) -> str:
    from sqlalchemy import select
    from sqlalchemy.ext.asyncio import create_async_engine

    from darkbloom.store.schema import accounts

    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            return str((await conn.execute(select(accounts.c.password_hash).where(accounts.c.email == email))).scalar())
    finally:
        await engine.dispose()


async def test_the_hash_cost_applies_to_new_passwords_and_old_ones_still_log_in(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"
    costs = ({}, {"password_hash_memory_kib": 19_456, "password_hash_time_cost": 2})
    for cost, email in zip(costs, ("ada@example.com", "bob@example.com")):
        app = create_app(CoordinatorSettings(database_url=url, **cost))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as client:
                assert (await client.post("/v1/auth/signup", json={"email": email, "password": PASSWORD})
                        ).status_code == 201
                assert await _attempt(client, "ada@example.com", PASSWORD) == 200
    assert "$m=65536,t=3," in await _stored_hash(url, "ada@example.com")
    assert "$m=19456,t=2," in await _stored_hash(url, "bob@example.com")


@pytest.mark.parametrize("cost", [{"password_hash_memory_kib": 19_455}, {"password_hash_time_cost": 1}])
def test_a_hash_cost_below_owasps_minimum_is_refused(cost: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="OWASP's minimum"):
        CoordinatorSettings(**cost)
