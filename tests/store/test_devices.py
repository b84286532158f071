"""Device codes (approve once, issue once), device tokens and the machines they link."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.wire.crypto import token_hash
from darkbloom.store import accounts, devices, machines
from darkbloom.store.machines import Seen

from tests.support.store_queries import has_linked


@pytest.fixture
async def account(engine: AsyncEngine) -> str:
    async with engine.begin() as conn:
        return await accounts.create_account(conn, "dev@example.com", "h")


async def test_code_lookup_by_user_code_and_device_code(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await devices.create_code(conn, token_hash("device-secret"), "ABCD-EFGH", ttl=900)
    async with engine.connect() as conn:
        by_user = await devices.by_user_code(conn, "ABCD-EFGH")
        by_device = await devices.by_device_code(conn, token_hash("device-secret"))
        assert await devices.by_user_code(conn, "ZZZZ-ZZZZ") is None
        assert await devices.by_device_code(conn, token_hash("other")) is None
    assert by_user is not None and by_user == by_device
    assert by_user["status"] == "pending" and by_user["account_id"] is None
    assert by_user["expires_at"] - by_user["created_at"] == 900


async def test_approve_exactly_once(engine: AsyncEngine, account: str) -> None:
    async with engine.begin() as conn:
        await devices.create_code(conn, token_hash("dc"), "AAAA-BBBB", ttl=900)
        other = await accounts.create_account(conn, "late@example.com", "h")
    async with engine.begin() as conn:
        assert await devices.approve(conn, "AAAA-BBBB", account)
        assert not await devices.approve(conn, "AAAA-BBBB", other)
        assert not await devices.approve(conn, "NOPE-NOPE", account)
    async with engine.connect() as conn:
        row = await devices.by_user_code(conn, "AAAA-BBBB")
    assert row is not None and row["status"] == "approved" and row["account_id"] == account


async def test_mark_issued_only_after_approval_and_only_once(engine: AsyncEngine, account: str) -> None:
    async with engine.begin() as conn:
        await devices.create_code(conn, token_hash("dc"), "CCCC-DDDD", ttl=900)
    async with engine.begin() as conn:
        assert not await devices.mark_issued(conn, token_hash("dc"))  # still pending
        assert await devices.approve(conn, "CCCC-DDDD", account)
        assert await devices.mark_issued(conn, token_hash("dc"))
        assert not await devices.mark_issued(conn, token_hash("dc"))
        assert not await devices.approve(conn, "CCCC-DDDD", account)  # issued is not pending
    async with engine.connect() as conn:
        row = await devices.by_device_code(conn, token_hash("dc"))
    assert row is not None and row["status"] == "issued"


async def _link(engine: AsyncEngine, account: str, token: str) -> str:
    async with engine.begin() as conn:
        machine_id = await machines.create(conn, account, name="laptop")
        await devices.create_token(conn, token_hash(token), machine_id, account)
    return machine_id


async def test_device_token_resolves_to_its_owner(engine: AsyncEngine, account: str) -> None:
    machine_id = await _link(engine, account, "dkp-token")
    assert machine_id.startswith("mach_")
    async with engine.connect() as conn:
        assert await devices.token_owner(conn, token_hash("dkp-token")) == (account, machine_id)
        assert await devices.token_owner(conn, token_hash("dkp-unknown")) is None


async def test_revoked_token_has_no_owner(engine: AsyncEngine, account: str) -> None:
    revoked_machine = await _link(engine, account, "dkp-revoked")
    kept_machine = await _link(engine, account, "dkp-kept")
    async with engine.begin() as conn:
        await devices.revoke_for_machine(conn, revoked_machine)
    async with engine.connect() as conn:
        assert await devices.token_owner(conn, token_hash("dkp-revoked")) is None
        assert await devices.token_owner(conn, token_hash("dkp-kept")) == (account, kept_machine)


async def test_unlinked_machine_token_has_no_owner(engine: AsyncEngine, account: str) -> None:
    machine_id = await _link(engine, account, "dkp-unlinked")
    async with engine.begin() as conn:
        other = await accounts.create_account(conn, "x@example.com", "h")
        assert not await machines.unlink(conn, other, machine_id)  # not theirs
        assert await machines.unlink(conn, account, machine_id)
        assert not await machines.unlink(conn, account, machine_id)  # only once
    async with engine.connect() as conn:
        # the token row itself is not revoked here; the unlinked machine alone is enough
        assert await devices.token_owner(conn, token_hash("dkp-unlinked")) is None


async def test_machine_list_and_record_seen(engine: AsyncEngine, account: str) -> None:
    async with engine.connect() as conn:
        assert not await has_linked(conn, account)
    first = await _link(engine, account, "dkp-1")
    second = await _link(engine, account, "dkp-2")
    async with engine.begin() as conn:
        await machines.record_seen(conn, {first: Seen(last_seen=1_700_000_000, models=["m1", "m2"],
                                                      trust_level="self_signed", private_only=True, name="desk",
                                                      identity_key="idkey")})
        await machines.unlink(conn, account, second)
    async with engine.connect() as conn:
        listed = await machines.list_for(conn, account)
        assert await has_linked(conn, account)
        unlinked = await machines.get(conn, second)
    assert [m["id"] for m in listed] == [first]
    row = listed[0]
    assert (row["models"], row["trust_level"], row["private_only"], row["name"], row["identity_key"],
            row["last_seen"]) == (["m1", "m2"], "self_signed", True, "desk", "idkey", 1_700_000_000)
    assert unlinked is not None and unlinked["unlinked_at"] is not None and unlinked["trust_level"] == "none"


async def test_record_seen_writes_many_in_one_statement_and_keeps_an_unnamed_name(engine: AsyncEngine,
                                                                                  account: str) -> None:
    named = await _link(engine, account, "dkp-x")
    unnamed = await _link(engine, account, "dkp-y")
    async with engine.begin() as conn:
        await machines.record_seen(conn, {named: Seen(1, ["a"], "none", False, name="box", identity_key="k1")})
        await machines.record_seen(conn, {
            named: Seen(2, ["m"], "hardware", True),  # no name or key given: the stored ones stay
            unnamed: Seen(3, [], "self_signed", False, identity_key="k2")})
        await machines.record_seen(conn, {})
    async with engine.connect() as conn:
        first, second = await machines.get(conn, named), await machines.get(conn, unnamed)
    assert first is not None and second is not None
    assert (first["last_seen"], first["models"], first["trust_level"], first["private_only"], first["name"],
            first["identity_key"]) == (2, ["m"], "hardware", True, "box", "k1")
    assert (second["last_seen"], second["models"], second["name"], second["identity_key"]) == \
        (3, [], "laptop", "k2")
