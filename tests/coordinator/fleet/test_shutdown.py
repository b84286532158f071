"""A coordinator holding a few hundred provider sessions stops on SIGTERM: it exits, every node hears
1012 "service restart" (docs/protocol.md "Reconnecting"), its log has no traceback, and the machine
book still writes what the closed sessions last said. Outcomes are asserted, never durations."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from darkbloom.store import accounts, create_engine, devices, machines, migrate
from darkbloom.store.schema import machines as machines_table
from darkbloom.wire.crypto import token_hash
from tests.support.processes import start_coordinator
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

SESSIONS = 300
SERVICE_RESTART = 1012


async def seed(database_url: str, count: int) -> list[str]:
    """``count`` linked machines of one account, a device token each (what `darkbloom login` leaves)."""
    engine = create_engine(database_url)
    await migrate(engine)
    tokens = ["dkp-" + secrets.token_urlsafe(24) for _ in range(count)]
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, "fleet@example.com", "h")
        for token in tokens:
            machine_id = await machines.create(conn, account_id, name="node")
            await devices.create_token(conn, token_hash(token), machine_id, account_id)
    await engine.dispose()
    return tokens


async def last_seen(database_url: str) -> list[int | None]:
    engine = create_engine(database_url)
    async with engine.connect() as conn:
        seen = [row[0] for row in await conn.execute(select(machines_table.c.last_seen))]
    await engine.dispose()
    return seen


async def hold_sessions(base_url: str, tokens: list[str]) -> list[RawProvider]:
    nodes = [RawProvider(base_url, token, models=("fleet-idle",)) for token in tokens]
    gate = asyncio.Semaphore(32)

    async def register(node: RawProvider) -> None:
        async with gate:
            await node.register()

    await asyncio.gather(*(register(node) for node in nodes))
    return nodes


async def test_sigterm_closes_every_session_with_service_restart(tmp_path: Path, postgres_url: str) -> None:
    tokens = await seed(postgres_url, SESSIONS)
    coord = start_coordinator(tmp_path / "home", postgres_url)
    try:
        nodes = await hold_sessions(coord.base_url, tokens)
        await asyncio.sleep(1.5)  # the registrations' machine marks are written (--machine-flush-interval 1 s)
        stopped_at = int(time.time())
        coord.process.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(node.ws.wait_closed() for node in nodes if node.ws is not None))
        exit_code = await asyncio.to_thread(coord.process.proc.wait, 120)
    finally:
        coord.process.kill()
    assert exit_code in (0, -signal.SIGTERM)  # uvicorn stops cleanly, then re-raises the signal it caught
    assert [node.ws.close_code for node in nodes if node.ws is not None] == [SERVICE_RESTART] * SESSIONS
    log = coord.process.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert "Cancel" not in log  # uvicorn's "Cancel N running task(s), timeout graceful shutdown exceeded"
    # each closed session marked its machine as last seen at the stop, and the book wrote it on the way out
    assert all(seen is not None and seen >= stopped_at for seen in await last_seen(postgres_url))
