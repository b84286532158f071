"""DeviceOwners: registrations arriving together share one query; alone, one query each; nothing is
cached (a revoked token is seen at once)."""

from __future__ import annotations

import asyncio
import secrets

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.device_owners import MAX_BATCH, DeviceOwners
from darkbloom.store import accounts, devices, machines
from darkbloom.wire.crypto import token_hash
from tests.coordinator.fleet.test_machine_book import count


async def linked(engine: AsyncEngine, count_: int) -> tuple[str, dict[str, str]]:
    """An account, and ``count_`` token hashes of its linked machines → the machine ids."""
    tokens: dict[str, str] = {}
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, f"{secrets.token_hex(4)}@example.com", "h")
        for _ in range(count_):
            digest = token_hash("dkp-" + secrets.token_urlsafe(16))
            tokens[digest] = await machines.create(conn, account_id, name="node")
            await devices.create_token(conn, digest, tokens[digest], account_id)
    return account_id, tokens


async def test_registrations_waiting_together_share_one_query(engine: AsyncEngine) -> None:
    account_id, tokens = await linked(engine, 40)
    owners = DeviceOwners(engine)
    unknown = token_hash("dkp-nobody")
    statements, stop = count(engine)
    try:
        found = await asyncio.gather(*(owners.owner(digest) for digest in [*tokens, unknown, *tokens]))
    finally:
        stop()
    assert found == [(account_id, m) for m in tokens.values()] + [None] + [(account_id, m) for m in tokens.values()]
    assert len(statements.statements) == 1


async def test_a_batch_holds_at_most_max_batch_tokens(engine: AsyncEngine) -> None:
    owners = DeviceOwners(engine)
    statements, stop = count(engine)
    try:
        found = await asyncio.gather(*(owners.owner(f"{n:064x}") for n in range(MAX_BATCH + 1)))
    finally:
        stop()
    assert found == [None] * (MAX_BATCH + 1)
    assert len(statements.statements) == 2


async def test_alone_one_query_each_and_revocation_is_seen_at_once(engine: AsyncEngine) -> None:
    account_id, tokens = await linked(engine, 1)
    [(digest, machine_id)] = tokens.items()
    owners = DeviceOwners(engine)
    statements, stop = count(engine)
    try:
        assert await owners.owner(digest) == (account_id, machine_id)
        async with engine.begin() as conn:
            await devices.revoke_for_machine(conn, machine_id)
        assert await owners.owner(digest) is None
    finally:
        stop()
    assert sum(1 for s in statements.statements if s.lstrip().upper().startswith("SELECT")) == 2
