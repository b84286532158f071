"""Sign-up and log-in are throttled per email and per client address (429 with Retry-After), in
memory or, with --redis-url, shared by the replicas. Real coordinator processes with the default
limits (the per-address log-in limit lowered to 12 so that spraying it takes 12 hashes, not 100);
clients are told apart by X-Forwarded-For, which the coordinator believes from 127.0.0.1 only by
default (DARKBLOOM_FORWARDED_ALLOW_IPS)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.coordinator.http.conftest import assert_error, unique_email
from tests.coordinator.money.test_ratelimit import REDIS_URL
from tests.support.processes import Coordinator, start_coordinator

PASSWORD = "correct horse battery"
ADDRESS_LOGIN_LIMIT = 12
EMAIL_LIMIT = 10   # the defaults docs/api.md promises
SIGNUP_LIMIT = 20


def _limits(**overrides: str) -> dict[str, str]:
    return {"DARKBLOOM_SIGNUPS_PER_ADDRESS": str(SIGNUP_LIMIT),
            "DARKBLOOM_LOGIN_FAILURES_PER_ADDRESS": str(ADDRESS_LOGIN_LIMIT), **overrides}


def _start(home: Path, database_url: str, *args: str, env: dict[str, str] | None = None) -> Coordinator:
    return start_coordinator(home, database_url, *args, env=env or _limits())


@pytest.fixture(scope="module", params=["memory", "redis"])
def replicas(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Coordinator]]:
    """One coordinator (memory), or two on one database and one Redis: every limit is theirs together."""
    root = tmp_path_factory.mktemp(f"throttle-{request.param}")
    url = f"sqlite+aiosqlite:///{root / 'coordinator.db'}"
    args = ("--redis-url", REDIS_URL) if request.param == "redis" else ()
    started = [_start(root / f"c{i}", url, *args) for i in range(2 if args else 1)]
    try:
        yield started * (2 // len(started))
    finally:
        for coordinator in started:
            coordinator.stop()


def _client() -> dict[str, str]:
    """A client address of its own (unique per run, since Redis keeps its buckets for an hour)."""
    return {"X-Forwarded-For": f"2001:db8::{secrets.token_hex(2)}:{secrets.token_hex(2)}"}


def _signup(coord: Coordinator, client: dict[str, str], email: str | None = None) -> httpx.Response:
    return httpx.post(coord.api_url + "/auth/signup", json={"email": email or unique_email(), "password": PASSWORD},
                      headers=client, timeout=60)


def _assert_throttled(resp: httpx.Response, longest_wait: int) -> None:
    error = assert_error(resp, 429, "rate_limit_exceeded")
    assert "Too many" in error["message"]
    assert 1 <= int(resp.headers["retry-after"]) <= longest_wait
    assert "x-should-retry" not in resp.headers


async def test_a_hundred_wrong_passwords_for_one_email_get_429_after_the_limit(replicas: list[Coordinator]) -> None:
    victim, other = unique_email(), unique_email()
    for email in (victim, other):
        assert _signup(replicas[0], _client(), email).status_code == 201
    attacker = _client()
    async with httpx.AsyncClient(timeout=120) as http:
        responses = await asyncio.gather(*(
            http.post(replicas[i % 2].api_url + "/auth/login", json={"email": victim, "password": f"guess-{i}"},
                      headers=attacker)
            for i in range(100)))
    assert Counter(r.status_code for r in responses) == {401: EMAIL_LIMIT, 429: 100 - EMAIL_LIMIT}
    for refused in (r for r in responses if r.status_code == 429):
        _assert_throttled(refused, 15 * 60 // EMAIL_LIMIT)
    # the email is throttled whoever asks and whatever the password; other accounts are not
    right = httpx.post(replicas[1].api_url + "/auth/login", json={"email": victim, "password": PASSWORD},
                       headers=_client())
    _assert_throttled(right, 15 * 60 // EMAIL_LIMIT)
    for coord in replicas:
        ok = httpx.post(coord.api_url + "/auth/login", json={"email": other, "password": PASSWORD}, headers=attacker)
        assert ok.status_code == 200, ok.text


def test_successful_log_ins_are_not_counted(replicas: list[Coordinator]) -> None:
    email, client = unique_email(), _client()
    assert _signup(replicas[0], client, email).status_code == 201
    for i in range(EMAIL_LIMIT + 5):
        ok = httpx.post(replicas[i % 2].api_url + "/auth/login", json={"email": email, "password": PASSWORD},
                        headers=client)
        assert ok.status_code == 200, ok.text


def test_wrong_passwords_over_many_emails_from_one_address_get_429(replicas: list[Coordinator]) -> None:
    sprayer = _client()
    statuses = [httpx.post(replicas[i % 2].api_url + "/auth/login",
                           json={"email": unique_email(), "password": "password1"}, headers=sprayer).status_code
                for i in range(ADDRESS_LOGIN_LIMIT + 3)]
    assert statuses == [401] * ADDRESS_LOGIN_LIMIT + [429] * 3
    assert httpx.post(replicas[0].api_url + "/auth/login", json={"email": unique_email(), "password": "password1"},
                      headers=_client()).status_code == 401  # another address is not held back


def test_sign_ups_from_one_address_get_429_after_the_limit(replicas: list[Coordinator]) -> None:
    client = _client()
    statuses = [_signup(replicas[i % 2], client).status_code for i in range(SIGNUP_LIMIT + 3)]
    assert statuses == [201] * SIGNUP_LIMIT + [429] * 3
    _assert_throttled(_signup(replicas[1], client), 60 * 60 // SIGNUP_LIMIT)
    assert _signup(replicas[0], _client()).status_code == 201  # another address still signs up


def test_x_forwarded_for_is_believed_only_from_a_trusted_proxy(tmp_path: Path) -> None:
    coord = _start(tmp_path / "c", f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}",
                   env=_limits(DARKBLOOM_SIGNUPS_PER_ADDRESS="3", DARKBLOOM_FORWARDED_ALLOW_IPS="none"))
    try:
        statuses = [_signup(coord, _client()).status_code for _ in range(5)]  # all from 127.0.0.1
    finally:
        coord.stop()
    assert statuses == [201] * 3 + [429] * 2
