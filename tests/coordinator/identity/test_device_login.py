"""Device-login expiry at the core level: there is no command-line flag for the code TTL, so these
tests build the coordinator's services with ``device_code_ttl=0`` (a code that is already expired)."""

from __future__ import annotations

import re
from typing import AsyncIterator

import pytest

from darkbloom.coordinator.identity import device_login
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import token_hash
from darkbloom.store import accounts, create_engine, devices, migrate


async def _services(database_url: str, ttl: int) -> Services:
    engine = create_engine(database_url)
    await migrate(engine)
    return Services(settings=CoordinatorSettings(database_url=database_url, device_code_ttl=ttl),
                    engine=engine, registry=Registry(), rate_limiter=MemoryRateLimiter())


@pytest.fixture
async def expired(database_url: str) -> AsyncIterator[Services]:
    services = await _services(database_url, ttl=0)
    try:
        yield services
    finally:
        await services.engine.dispose()


async def _account(services: Services) -> str:
    async with services.engine.begin() as conn:
        return await accounts.create_account(conn, "owner@example.com", "h")


async def test_approving_an_expired_code_is_410_expired_code(expired: Services) -> None:
    account_id = await _account(expired)
    code = await device_login.start(expired)
    assert code["expires_in"] == 0
    with pytest.raises(ApiError) as caught:
        await device_login.approve(expired, account_id, code["user_code"])
    assert (caught.value.status, caught.value.type, caught.value.code) == (410, "expired_code", "expired_code")
    async with expired.engine.connect() as conn:
        row = await devices.by_user_code(conn, code["user_code"])
    assert row is not None and row["status"] == "pending" and row["account_id"] is None


async def test_polling_an_expired_pending_code_is_410_expired_token(expired: Services) -> None:
    code = await device_login.start(expired)
    with pytest.raises(ApiError) as caught:
        await device_login.exchange(expired, code["device_code"])
    assert (caught.value.status, caught.value.type) == (410, "expired_token")


async def test_already_used_wins_over_expired(expired: Services) -> None:
    """A code that was approved is reported as used, whatever its age."""
    account_id = await _account(expired)
    code = await device_login.start(expired)
    async with expired.engine.begin() as conn:
        assert await devices.approve(conn, code["user_code"], account_id)
    with pytest.raises(ApiError) as caught:
        await device_login.approve(expired, account_id, code["user_code"])
    assert (caught.value.status, caught.value.type) == (409, "already_used")


async def test_live_code_flow_at_the_core(database_url: str) -> None:
    services = await _services(database_url, ttl=900)
    try:
        account_id = await _account(services)
        code = await device_login.start(services)
        assert re.fullmatch(r"[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}-[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}",
                            code["user_code"])
        async with services.engine.connect() as conn:
            stored = await devices.by_device_code(conn, token_hash(code["device_code"]))
        assert stored is not None and stored["user_code"] == code["user_code"]
        assert stored["expires_at"] - stored["created_at"] == 900

        assert await device_login.exchange(services, code["device_code"]) == {"status": "authorization_pending"}
        await device_login.approve(services, account_id, f" {code['user_code'].lower()} ")
        issued = await device_login.exchange(services, code["device_code"])
        assert issued["status"] == "authorized" and issued["account_id"] == account_id
        async with services.engine.connect() as conn:
            assert await devices.token_owner(conn, token_hash(issued["token"])) == \
                (account_id, issued["machine_id"])
        with pytest.raises(ApiError) as caught:
            await device_login.exchange(services, code["device_code"])
        assert (caught.value.status, caught.value.type) == (404, "invalid_grant")
    finally:
        await services.engine.dispose()


def test_user_codes_use_only_the_unambiguous_alphabet() -> None:
    alphabet = set(device_login.USER_CODE_ALPHABET)
    assert not alphabet & set("01ILO")
    for _ in range(200):
        code = device_login._user_code()
        assert len(code) == 9 and code[4] == "-"
        assert set(code.replace("-", "")) <= alphabet
