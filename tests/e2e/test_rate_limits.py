"""Rate limits through the real coordinator: RPM, ITPM and OTPM each tripped with the right headers,
and two coordinator processes sharing one Redis enforce one limit, not two."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack
from tests.support.processes import start_coordinator

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 8}


def _key(stack: Stack, **limits: int) -> dict[str, str]:
    response = httpx.post(stack.coordinator.api_url + "/keys", json={"name": "limited", **limits},
                          headers={"Authorization": f"Bearer {stack.owner.session}"})
    response.raise_for_status()
    return {"Authorization": f"Bearer {response.json()['key']}"}


def _until_refused(stack: Stack, headers: dict[str, str], body: dict[str, object], attempts: int = 20) -> httpx.Response:
    for _ in range(attempts):
        response = httpx.post(stack.coordinator.api_url + "/chat/completions", json=body, headers=headers,
                              timeout=60)
        if response.status_code == 429:
            return response
        assert response.status_code == 200, response.text
        assert "x-ratelimit-remaining-requests" in response.headers or \
            "x-ratelimit-remaining-input-tokens" in response.headers or \
            "x-ratelimit-remaining-output-tokens" in response.headers
    raise AssertionError(f"no 429 within {attempts} requests")


def _assert_refusal(response: httpx.Response, dimension: str, header: str, limit: int,
                    hopeless: bool = False) -> None:
    error = response.json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded"
    assert error["param"] == dimension
    if hopeless:  # larger than the whole bucket: no wait admits it, so no Retry-After and no retries
        assert response.headers["x-should-retry"] == "false" and "retry-after" not in response.headers
    else:
        assert int(response.headers["retry-after"]) >= 1 and "x-should-retry" not in response.headers
    assert response.headers[f"x-ratelimit-limit-{header}"] == str(limit)
    assert int(response.headers[f"x-ratelimit-remaining-{header}"]) >= 0


def test_rpm_limit(stack: Stack) -> None:
    headers = _key(stack, rpm_limit=2)
    refused = _until_refused(stack, headers, SHORT, attempts=3)
    _assert_refusal(refused, "requests", "requests", 2)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per minute" in refused.json()["error"]["message"]


def test_itpm_limit(stack: Stack) -> None:
    headers = _key(stack, itpm_limit=300)
    refused = _until_refused(stack, headers, SHORT)
    _assert_refusal(refused, "input_tokens", "input-tokens", 300)


def test_otpm_limit(stack: Stack) -> None:
    headers = _key(stack, otpm_limit=40)
    refused = _until_refused(stack, headers, {**SHORT, "max_tokens": 30})
    _assert_refusal(refused, "output_tokens", "output-tokens", 40)
    too_big = httpx.post(stack.coordinator.api_url + "/chat/completions", json={**SHORT, "max_tokens": 41},
                         headers=headers, timeout=60)
    _assert_refusal(too_big, "output_tokens", "output-tokens", 40, hopeless=True)


def test_refused_requests_cost_nothing(stack: Stack) -> None:
    before = httpx.get(stack.coordinator.api_url + "/payments/balance", headers=stack.owner.headers()).json()
    headers = _key(stack, otpm_limit=10)
    refused = httpx.post(stack.coordinator.api_url + "/chat/completions", json={**SHORT, "max_tokens": 11},
                         headers=headers, timeout=60)
    assert refused.status_code == 429
    after = httpx.get(stack.coordinator.api_url + "/payments/balance", headers=stack.owner.headers()).json()
    assert after == before


def test_two_coordinators_sharing_redis_enforce_one_limit(tmp_path: Path, postgres_url: str) -> None:
    redis_url = "redis://127.0.0.1:6379/0"
    first = start_coordinator(tmp_path / "a", postgres_url, "--redis-url", redis_url)
    second = start_coordinator(tmp_path / "b", postgres_url, "--redis-url", redis_url)
    try:
        email = f"rl-{secrets.token_hex(4)}@example.com"
        signup = httpx.post(first.api_url + "/auth/signup", json={"email": email, "password": "long enough 1"}).json()
        key = httpx.post(first.api_url + "/keys", json={"name": "shared", "rpm_limit": 10},
                         headers={"Authorization": f"Bearer {signup['token']}"}).json()["key"]
        httpx.post(first.api_url + "/admin/credit", headers=first.admin(), json={
            "account_id": signup["account_id"], "amount_micro_usd": 1_000_000, "reference": "rl"}).raise_for_status()
        headers = {"Authorization": f"Bearer {key}"}
        admitted = {first.base_url: 0, second.base_url: 0}
        statuses: list[int] = []
        started = time.monotonic()
        with httpx.Client(timeout=30) as http:
            for i in range(40):
                coordinator = first if i % 2 == 0 else second
                # no provider serves the model, so an admitted request ends in a fast 503 (its request
                # still counts); a refused one is a 429 before anything else happens
                response = http.post(coordinator.api_url + "/chat/completions", json=SHORT, headers=headers)
                statuses.append(response.status_code)
                if response.status_code != 429:
                    admitted[coordinator.base_url] += 1
        elapsed = time.monotonic() - started
        total = sum(admitted.values())
        refill_allowance = int(elapsed * 10 / 60) + 1
        assert 10 <= total <= 10 + refill_allowance, (admitted, elapsed, statuses)
        assert all(count > 0 for count in admitted.values()), admitted
    finally:
        first.stop()
        second.stop()
