"""Every inference route takes one request from the caller's RPM buckets right after authentication,
before the body is read, and never gives it back (docs/billing.md "Rate limits"): counting tokens
counts, a request later refused (400, 402, 404) counts, and once a bucket is empty the 429 comes
without the body being read. The coordinator app runs in the test's event loop; the shared-Redis
case runs two of them, as two replicas."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.services import Services
from darkbloom.store import keys
from darkbloom.wire.crypto import new_token, token_hash
from tests.coordinator.money.conftest import new_account
from tests.coordinator.money.test_ratelimit import REDIS_URL

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": MODEL, "max_tokens": 8, "messages": HELLO}
LIMIT, EXTRA = 3, 2
PAID = [  # every inference route, with a body a broke caller is refused for at the reservation (402)
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 8}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 8}),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
    ("/v1/messages", MESSAGES),
]
INFERENCE = [path for path, _ in PAID] + ["/v1/messages/count_tokens"]


class Replica:
    def __init__(self, http: httpx.AsyncClient, services: Services) -> None:
        self.http, self.services = http, services

    async def post(self, path: str, token: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, headers={"Authorization": f"Bearer {token}", **(headers or {})}, **kwargs)


@contextlib.asynccontextmanager
async def replica(database_url: str, **settings: Any) -> AsyncIterator[Replica]:
    app = create_app(CoordinatorSettings(database_url=database_url, **settings))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as http:
            yield Replica(http, app.state.services)


async def caller(services: Services, credit: int = 0, **key_fields: Any) -> str:
    """A new account's API key (the account holds ``credit`` µUSD)."""
    account = await new_account(services, credit=credit)
    token = new_token("dk-")
    async with services.engine.begin() as conn:
        await keys.create(conn, account, token_hash(token), token[:8], {"name": "rpm", **key_fields})
    return token


def assert_rate_limited(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 429, response.text
    body = response.json()
    error = body["error"]
    if "type" in body:  # Anthropic's envelope, on /v1/messages and under it
        assert error["type"] == "rate_limit_error"
    else:
        assert error["type"] == error["code"] == "rate_limit_exceeded" and error["param"] == "requests"
    assert "requests per minute" in error["message"]
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-ratelimit-limit-requests"] == str(limit)
    assert response.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize("limited_by", ["account", "key"])
async def test_count_tokens_counts_against_rpm(sqlite_url: str, limited_by: str) -> None:
    settings = {"account_rpm": LIMIT} if limited_by == "account" else {}
    async with replica(sqlite_url, **settings) as coordinator:
        token = await caller(coordinator.services, **({"rpm_limit": LIMIT} if limited_by == "key" else {}))
        answers = [await coordinator.post("/v1/messages/count_tokens", token, json=MESSAGES)
                   for _ in range(LIMIT + EXTRA)]
    for i, counted in enumerate(answers[:LIMIT]):
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > 0
        assert counted.headers["x-ratelimit-limit-requests"] == str(LIMIT)
        assert counted.headers["x-ratelimit-remaining-requests"] == str(LIMIT - 1 - i)
    for refused in answers[LIMIT:]:
        assert_rate_limited(refused, LIMIT)


@pytest.mark.parametrize("path, body", PAID)
async def test_requests_refused_for_want_of_funds_still_count(sqlite_url: str, path: str,
                                                              body: dict[str, Any]) -> None:
    async with replica(sqlite_url, account_rpm=LIMIT) as coordinator:
        broke = await caller(coordinator.services)
        answers = [await coordinator.post(path, broke, json=body) for _ in range(LIMIT + EXTRA)]
    assert [a.status_code for a in answers] == [402] * LIMIT + [429] * EXTRA, [a.text for a in answers]
    for refused in answers[LIMIT:]:
        assert_rate_limited(refused, LIMIT)


async def test_requests_refused_before_admission_still_count(sqlite_url: str) -> None:
    """A malformed body, an unknown model, a key's disallowed model: each took its request."""
    async with replica(sqlite_url) as coordinator:
        token = await caller(coordinator.services, credit=1_000_000, rpm_limit=LIMIT, allowed_models=["other"])
        answers = [await coordinator.post("/v1/chat/completions", token, content=b"{not json"),
                   await coordinator.post("/v1/messages", token, json={**MESSAGES, "model": "no-such-model"}),
                   await coordinator.post("/v1/messages/count_tokens", token, json=MESSAGES),
                   await coordinator.post("/v1/chat/completions", token, json={"model": MODEL, "messages": HELLO})]
    assert [a.status_code for a in answers] == [400, 404, 403, 429], [a.text for a in answers]
    assert_rate_limited(answers[-1], LIMIT)


class WatchedBody:
    """A request body that records whether anything read it."""

    def __init__(self, body: bytes) -> None:
        self.body, self.read = body, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.read = True
        yield self.body


async def test_an_empty_bucket_refuses_before_the_body_is_read(sqlite_url: str) -> None:
    async with replica(sqlite_url, account_rpm=1) as coordinator:
        token = await caller(coordinator.services)
        assert (await coordinator.post("/v1/messages/count_tokens", token, json=MESSAGES)).status_code == 200
        for path in INFERENCE:
            body = WatchedBody(b'{"model": "smollm2-135m", "messages": [' + b"0," * 100_000 + b"0]}")
            refused = await coordinator.post(path, token, content=body, headers={"Content-Type": "application/json"})
            assert_rate_limited(refused, 1)
            assert not body.read, path


async def test_self_routed_requests_still_count(sqlite_url: str) -> None:
    async with replica(sqlite_url) as coordinator:
        token = await caller(coordinator.services, rpm_limit=1, self_route_only=True)
        first = await coordinator.post("/v1/chat/completions", token, json={"model": MODEL, "messages": HELLO})
        second = await coordinator.post("/v1/chat/completions", token, json={"model": MODEL, "messages": HELLO})
    assert first.status_code == 409 and first.json()["error"]["code"] == "no_linked_machine", first.text
    assert_rate_limited(second, 1)


async def test_replicas_sharing_redis_share_the_request_bucket(tmp_path: Path) -> None:
    """Two coordinators on one database and one Redis: requests alternating between them, counted
    tokens and refused ones alike, take from one bucket (its key is the account's, so no other test's)."""
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    async with replica(database_url, account_rpm=LIMIT, redis_url=REDIS_URL) as first, \
            replica(database_url, account_rpm=LIMIT, redis_url=REDIS_URL) as second:
        broke = await caller(first.services)
        answers = []
        for i in range(2 * LIMIT):
            coordinator = (first, second)[i % 2]
            path = "/v1/messages/count_tokens" if i % 3 == 0 else "/v1/messages"
            answers.append(await coordinator.post(path, broke, json=MESSAGES))
    assert sum(a.status_code != 429 for a in answers) == LIMIT, [a.status_code for a in answers]
    for refused in answers[LIMIT:]:
        assert_rate_limited(refused, LIMIT)
