"""Admin credits (docs/api.md "Admin"): by account id or email, idempotent on reference."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx
import pytest
from sqlalchemy import update

from darkbloom.coordinator.http.routes.admin import MAX_BALANCE, MAX_CREDIT
from darkbloom.store import create_engine, schema
from tests.coordinator.http.conftest import Account, Api, assert_error, bearer


def _balance(api: Api, token: str) -> int:
    return int(api.get("/v1/payments/balance", headers=bearer(token)).json()["balance_micro_usd"])


def test_credit_by_account_id(api: Api) -> None:
    account = api.signup()
    resp = api.credit(account, 1_500_000)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"account_id": account.account_id, "balance_micro_usd": 1_500_000}
    assert _balance(api, account.token) == 1_500_000


def test_credit_by_email(api: Api) -> None:
    account = api.signup()
    resp = api.post("/v1/admin/credit", headers=api.coordinator.admin(),
                    json={"email": f" {account.email.upper()} ", "amount_micro_usd": 42, "reference": uuid.uuid4().hex})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"account_id": account.account_id, "balance_micro_usd": 42}
    assert _balance(api, account.token) == 42


def test_credit_is_idempotent_on_reference(api: Api) -> None:
    account = api.signup()
    reference = "grant-" + uuid.uuid4().hex
    first = api.credit(account, 700, reference)
    again = api.credit(account, 700, reference)
    assert first.status_code == again.status_code == 200
    assert first.json()["balance_micro_usd"] == again.json()["balance_micro_usd"] == 700
    assert api.credit(account, 300).json()["balance_micro_usd"] == 1000
    assert _balance(api, account.token) == 1000


@pytest.mark.parametrize("token", [None, "wrong-token", "test-admin-token-but-longer"])
def test_wrong_admin_token_is_401(api: Api, shared_account: Account, token: str | None) -> None:
    account = shared_account  # never credited: every test on it must fail
    headers = bearer(token) if token else {}
    resp = api.post("/v1/admin/credit", headers=headers,
                    json={"account_id": account.account_id, "amount_micro_usd": 5, "reference": uuid.uuid4().hex})
    assert_error(resp, 401, "invalid_api_key")
    assert _balance(api, account.token) == 0


def test_a_user_token_is_not_an_admin_token(api: Api, shared_account: Account) -> None:
    account = shared_account  # never credited: every test on it must fail
    resp = api.post("/v1/admin/credit", headers=account.auth,
                    json={"account_id": account.account_id, "amount_micro_usd": 5, "reference": uuid.uuid4().hex})
    assert_error(resp, 401, "invalid_api_key")
    assert _balance(api, account.token) == 0


def test_credit_for_an_unknown_account_is_404(api: Api) -> None:
    admin = api.coordinator.admin()
    for target in ({"account_id": "acct_nobody"}, {"email": "nobody-here@example.com"}, {}):
        resp = api.post("/v1/admin/credit", headers=admin,
                        json={**target, "amount_micro_usd": 5, "reference": uuid.uuid4().hex})
        assert_error(resp, 404, "account_not_found")


@pytest.mark.parametrize("body, param", [
    ({"amount_micro_usd": 0}, "amount_micro_usd"),
    ({"amount_micro_usd": -5}, "amount_micro_usd"),
    ({"amount_micro_usd": 1.5}, "amount_micro_usd"),
    ({"amount_micro_usd": "100"}, "amount_micro_usd"),
    ({"amount_micro_usd": True}, "amount_micro_usd"),
    ({"amount_micro_usd": 2**63}, "amount_micro_usd"),  # does not fit a BIGINT
    ({"amount_micro_usd": 2**62}, "amount_micro_usd"),  # two of these summed past 2**63 - 1 (a REAL on SQLite)
    ({"amount_micro_usd": 10**15 + 1}, "amount_micro_usd"),  # over the largest single credit
    ({"amount_micro_usd": 5, "reference": ""}, "reference"),
    ({"amount_micro_usd": 5, "reference": None}, "reference"),
])
def test_bad_credit_is_400(api: Api, shared_account: Account, body: dict, param: str) -> None:
    account = shared_account  # never credited: every test on it must fail
    payload = {"account_id": account.account_id, "reference": uuid.uuid4().hex, **body}
    error = assert_error(api.post("/v1/admin/credit", headers=api.coordinator.admin(), json=payload),
                         400, "invalid_request_error")
    assert error["param"] == param
    assert _balance(api, account.token) == 0


def test_credits_never_take_a_balance_out_of_the_integer_range(api: Api) -> None:
    account = api.signup()
    for _ in range(3):
        assert api.credit(account, 10**15).status_code == 200
    balance = api.get("/v1/payments/balance", headers=account.auth).json()["balance_micro_usd"]
    assert balance == 3 * 10**15 and isinstance(balance, int)


async def _set_balance(database_url: str, account_id: str, balance: int) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(update(schema.accounts).where(schema.accounts.c.id == account_id)
                               .values(balance_micro_usd=balance))
    finally:
        await engine.dispose()


async def test_concurrent_credits_near_the_cap_never_take_the_balance_past_it(api: Api) -> None:
    account = api.signup()
    room = 5
    await _set_balance(api.coordinator.database_url, account.account_id, MAX_BALANCE - room * MAX_CREDIT)
    async with httpx.AsyncClient(base_url=api.coordinator.base_url, timeout=60) as client:
        responses = await asyncio.gather(*(
            client.post("/v1/admin/credit", headers=api.coordinator.admin(),
                        json={"account_id": account.account_id, "amount_micro_usd": MAX_CREDIT,
                              "reference": uuid.uuid4().hex})
            for _ in range(16)))
    assert Counter(r.status_code for r in responses) == {200: room, 400: 16 - room}, [r.text for r in responses]
    for refused in (r for r in responses if r.status_code == 400):
        assert assert_error(refused, 400, "invalid_request_error")["param"] == "amount_micro_usd"
    assert max(r.json()["balance_micro_usd"] for r in responses if r.status_code == 200) == MAX_BALANCE
    assert _balance(api, account.token) == MAX_BALANCE


def test_admin_reads_the_catalog(api: Api) -> None:
    resp = api.get("/v1/admin/catalog", headers=api.coordinator.admin())
    assert resp.status_code == 200
    models = {m["id"]: m for m in resp.json()["models"]}
    assert models["smollm2-135m"]["input_price"] == 50_000
    assert models["smollm2-135m"]["output_price"] == 200_000
    assert_error(api.get("/v1/admin/catalog"), 401, "invalid_api_key")


SMOLLM_SOURCE = {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "file": "smollm2-135m-instruct-q8_0.gguf",
                 "revision": "main"}


def test_the_public_catalog_names_sources_sizes_and_prices(api: Api) -> None:
    before = api.get("/v1/admin/catalog", headers=api.coordinator.admin()).json()
    entry = {"id": "smollm2-135m", "input_price": 50_000, "output_price": 200_000, "max_output_tokens": 2048,
             "weight_hash": "sha256:" + "0" * 64, "source": SMOLLM_SOURCE, "size_bytes": 144_811_616,
             "context_length": 8192}
    try:
        resp = api.put("/v1/admin/catalog", headers=api.coordinator.admin(), json={"models": [entry]})
        assert resp.status_code == 200, resp.text
        public = api.get("/v1/models/catalog")  # no auth: a price list
        assert public.status_code == 200, public.text
        assert public.json() == {"object": "list", "data": [{**entry, "aliases": [], "format": "gguf"}]}
        # an MLX model's source names its repo, no file
        mlx = {**entry, "format": "mlx", "source": {"repo": "mlx-community/SmolLM2-135M-Instruct-8bit"}}
        resp = api.put("/v1/admin/catalog", headers=api.coordinator.admin(), json={"models": [mlx]})
        assert resp.status_code == 200, resp.text
        assert api.get("/v1/models/catalog").json()["data"] == [{**mlx, "aliases": [], "source": {
            "repo": "mlx-community/SmolLM2-135M-Instruct-8bit", "revision": "main"}}]
    finally:
        api.put("/v1/admin/catalog", headers=api.coordinator.admin(), json=before)


@pytest.mark.parametrize("bad", [
    {"weight_hash": "sha256:XYZ"},
    {"weight_hash": "md5:" + "0" * 32},
    {"source": {"repo": "no-slash", "file": "a.gguf"}},
    {"source": {"repo": "a/b", "file": "weights.bin"}},
    {"source": {"repo": "a/b", "file": "a.gguf", "extra": 1}},
    {"source": {"repo": "a/b"}},
    {"format": "mlx", "source": {"repo": "a/b", "file": "a.gguf"}},
    {"format": "onnx"},
    {"size_bytes": -1},
    {"context_length": 0},
])
def test_a_catalog_with_a_malformed_weight_entry_is_refused(api: Api, bad: dict[str, object]) -> None:
    entry = {"id": "smollm2-135m", "input_price": 1, "output_price": 1, **bad}
    resp = api.put("/v1/admin/catalog", headers=api.coordinator.admin(), json={"models": [entry]})
    assert_error(resp, 400, "invalid_request_error")
    assert api.get("/v1/models/catalog").json()["data"][0]["input_price"] != 1
