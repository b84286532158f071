"""API keys: only hashes stored; lookup by hash, per-account reads, pagination, edits, revocation."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.wire.crypto import token_hash
from darkbloom.store import accounts, keys


@pytest.fixture
async def two_accounts(engine: AsyncEngine) -> tuple[str, str]:
    async with engine.begin() as conn:
        return (await accounts.create_account(conn, "owner@example.com", "h"),
                await accounts.create_account(conn, "other@example.com", "h"))


async def _create(engine: AsyncEngine, account_id: str, secret: str, **fields: object) -> dict:
    async with engine.begin() as conn:
        return await keys.create(conn, account_id, token_hash(secret), secret[:10], {"name": "k", **fields})


async def test_create_stores_defaults_and_fields(engine: AsyncEngine, two_accounts: tuple[str, str]) -> None:
    owner, _ = two_accounts
    plain = await _create(engine, owner, "dk-plain-secret")
    assert plain["id"].startswith("key_")
    assert plain["account_id"] == owner
    assert plain["key_hash"] == token_hash("dk-plain-secret")
    assert plain["key_prefix"] == "dk-plain-s"
    assert plain["self_route_only"] is False
    assert plain["limit_reset"] == "none"
    assert plain["limit_micro_usd"] is None and plain["allowed_models"] is None
    assert plain["revoked_at"] is None

    full = await _create(engine, owner, "dk-full-secret", self_route_only=True, limit_micro_usd=2_500_000,
                         limit_reset="daily", rpm_limit=10, itpm_limit=1000, otpm_limit=500,
                         allowed_models=["a", "b"])
    assert full["self_route_only"] is True
    assert full["limit_micro_usd"] == 2_500_000
    assert (full["limit_reset"], full["rpm_limit"], full["itpm_limit"], full["otpm_limit"]) == \
        ("daily", 10, 1000, 500)
    assert full["allowed_models"] == ["a", "b"]


async def test_by_hash_finds_the_key_and_nothing_else(engine: AsyncEngine, two_accounts: tuple[str, str]) -> None:
    owner, _ = two_accounts
    row = await _create(engine, owner, "dk-secret")
    async with engine.connect() as conn:
        found = await keys.by_hash(conn, token_hash("dk-secret"))
        assert await keys.by_hash(conn, token_hash("dk-wrong")) is None
        assert await keys.by_hash(conn, "dk-secret") is None  # the secret itself is not stored
    assert found is not None and found["id"] == row["id"] and found["account_id"] == owner


async def test_get_is_scoped_to_the_account(engine: AsyncEngine, two_accounts: tuple[str, str]) -> None:
    owner, other = two_accounts
    row = await _create(engine, owner, "dk-mine")
    async with engine.connect() as conn:
        assert (await keys.get(conn, owner, row["id"]))["id"] == row["id"]  # type: ignore[index]
        assert await keys.get(conn, other, row["id"]) is None
        assert await keys.get(conn, owner, "key_missing") is None


async def test_list_pages_by_id_cursor(engine: AsyncEngine, two_accounts: tuple[str, str]) -> None:
    owner, other = two_accounts
    created = {(await _create(engine, owner, f"dk-owner-{i}"))["id"] for i in range(5)}
    await _create(engine, other, "dk-other-0")

    seen: list[str] = []
    after: str | None = None
    async with engine.connect() as conn:
        while True:
            page = await keys.list_for(conn, owner, 2, after)
            assert len(page) <= 2
            if not page:
                break
            seen.extend(r["id"] for r in page)
            after = page[-1]["id"]
    assert seen == sorted(seen)
    assert set(seen) == created and len(seen) == 5


async def test_update_fields_changes_only_what_is_given(engine: AsyncEngine,
                                                        two_accounts: tuple[str, str]) -> None:
    owner, other = two_accounts
    row = await _create(engine, owner, "dk-edit", rpm_limit=5)
    async with engine.begin() as conn:
        updated = await keys.update_fields(conn, owner, row["id"], {"name": "renamed", "self_route_only": True})
    assert updated is not None
    assert (updated["name"], updated["self_route_only"], updated["rpm_limit"]) == ("renamed", True, 5)

    async with engine.begin() as conn:
        assert await keys.update_fields(conn, other, row["id"], {"name": "stolen"}) is None
        unchanged = await keys.update_fields(conn, owner, row["id"], {})
    assert unchanged is not None and unchanged["name"] == "renamed"

    async with engine.begin() as conn:
        cleared = await keys.update_fields(conn, owner, row["id"], {"rpm_limit": None, "allowed_models": ["m"]})
    assert cleared is not None and cleared["rpm_limit"] is None and cleared["allowed_models"] == ["m"]


async def test_revoke_hides_the_key_everywhere(engine: AsyncEngine, two_accounts: tuple[str, str]) -> None:
    owner, other = two_accounts
    row = await _create(engine, owner, "dk-gone")
    keep = await _create(engine, owner, "dk-kept")
    async with engine.begin() as conn:
        assert not await keys.revoke(conn, other, row["id"])  # not theirs
        assert await keys.revoke(conn, owner, row["id"])
        assert not await keys.revoke(conn, owner, row["id"])  # only once
    async with engine.connect() as conn:
        assert await keys.by_hash(conn, token_hash("dk-gone")) is None
        assert await keys.get(conn, owner, row["id"]) is None
        assert [r["id"] for r in await keys.list_for(conn, owner, 10, None)] == [keep["id"]]
    async with engine.begin() as conn:
        assert await keys.update_fields(conn, owner, row["id"], {"name": "zombie"}) is None
