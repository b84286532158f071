"""Exactly-once steps stay exactly-once when the same request arrives many times at once."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx

from tests.coordinator.http.conftest import Api, bearer, unique_email

PARALLEL = 8


async def _many(api: Api, method: str, path: str, bodies: list[dict], headers: list[dict] | None = None
                ) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=api.coordinator.base_url, timeout=30) as client:
        return await asyncio.gather(*(
            client.request(method, path, json=body, headers=(headers or [{}] * len(bodies))[i])
            for i, body in enumerate(bodies)))


async def test_concurrent_token_polls_issue_one_token(api: Api) -> None:
    account = api.signup()
    code = api.post("/v1/device/code").json()
    assert api.post("/v1/device/approve", json={"user_code": code["user_code"]},
                    headers=account.auth).status_code == 200
    responses = await _many(api, "POST", "/v1/device/token", [{"device_code": code["device_code"]}] * PARALLEL)
    outcomes = Counter((r.status_code, r.json().get("status") or r.json()["error"]["code"]) for r in responses)
    assert outcomes == {(200, "authorized"): 1, (404, "invalid_grant"): PARALLEL - 1}
    assert len(api.get("/v1/me/providers", headers=account.auth).json()["data"]) == 1


async def test_concurrent_approvals_approve_once(api: Api) -> None:
    approvers = [api.signup() for _ in range(4)]
    code = api.post("/v1/device/code").json()
    responses = await _many(api, "POST", "/v1/device/approve", [{"user_code": code["user_code"]}] * len(approvers),
                            [a.auth for a in approvers])
    outcomes = Counter(r.status_code for r in responses)
    assert outcomes == {200: 1, 409: len(approvers) - 1}
    winner = approvers[[r.status_code for r in responses].index(200)]
    token = api.post("/v1/device/token", json={"device_code": code["device_code"]}).json()
    assert token["account_id"] == winner.account_id


async def test_concurrent_credits_with_one_reference_credit_once(api: Api) -> None:
    account = api.signup()
    body = {"account_id": account.account_id, "amount_micro_usd": 250, "reference": uuid.uuid4().hex}
    responses = await _many(api, "POST", "/v1/admin/credit", [body] * PARALLEL,
                            [api.coordinator.admin()] * PARALLEL)
    assert [r.status_code for r in responses] == [200] * PARALLEL
    balance = api.get("/v1/payments/balance", headers=bearer(account.token)).json()["balance_micro_usd"]
    assert balance == 250


async def test_concurrent_signups_with_one_email_create_one_account(api: Api) -> None:
    email = unique_email()
    responses = await _many(api, "POST", "/v1/auth/signup",
                            [{"email": email, "password": f"password-{i}"} for i in range(4)])
    assert Counter(r.status_code for r in responses) == {201: 1, 409: 3}
    winner = next(i for i, r in enumerate(responses) if r.status_code == 201)
    login = api.post("/v1/auth/login", json={"email": email, "password": f"password-{winner}"})
    assert login.status_code == 200
    assert login.json()["account_id"] == responses[winner].json()["account_id"]
