"""The batch runner in one process, on each database: lines leased and served through simulated
sessions (answered once, with usage rows naming the batch), a lease lost before the answer is kept
(nothing charged), a runner that stops (its lines back at once), an expired window, and two runners
sharing a batch (each line once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import Headers

from darkbloom.coordinator.batches import batch_api, file_api
from darkbloom.coordinator.batches.runner import BatchRunner
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.identity.api_keys import ApiKey
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money.ratelimit import create_rate_limiter
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts, batches, files, keys
from darkbloom.store.schema import batch_lines, usage_records
from darkbloom.wire.catalog import BUNDLED_MODEL_ID
from darkbloom.wire.crypto import token_hash
from darkbloom.wire.protocol import InferenceRequest
from tests.coordinator.routing.sim import SimProvider, fleet, settings


def lines(count: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": BUNDLED_MODEL_ID, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}) + "\n"
        for i in range(count)).encode()


@contextlib.asynccontextmanager
async def world(engine: AsyncEngine, **fields: Any) -> AsyncIterator[tuple[Services, Caller]]:
    services = Services(settings=settings(batch_poll_interval=0.05, batch_retry_seconds=1, **fields), engine=engine,
                        registry=Registry(), rate_limiter=create_rate_limiter(None))
    async with engine.begin() as conn:
        account = await accounts.create_account(conn, None, None)
        await accounts.credit(conn, account, 100_000_000, "test-credit")
    try:
        yield services, Caller(account, "console_session")
    finally:
        await services.drain(5)
        await services.ledger.close()


async def new_batch(services: Services, caller: Caller, count: int) -> str:
    uploaded = await file_api.upload(services, caller, "batch", "in.jsonl", lines(count))
    created = await batch_api.create(services, caller, Headers(), {
        "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    return str(created["id"])


async def answer(provider: SimProvider, count: int) -> list[str]:
    """Answer the next ``count`` requests the provider receives; their ids."""
    answered = []
    for _ in range(count):
        request: InferenceRequest = await provider.next_request(timeout=10)
        assert request.priority == "batch"  # the node's engine runs it behind live requests
        provider.reply(request.request_id, "ok")
        provider.complete(request.request_id)
        answered.append(request.request_id)
    return answered


async def until(services: Services, batch_id: str, *statuses: str, runner: BatchRunner | None = None) -> dict[str, Any]:
    for _ in range(400):
        if runner is not None:
            await runner.step()
        async with services.engine.connect() as conn:
            row = await batches.get(conn, None, batch_id)
        assert row is not None
        if row["status"] in statuses:
            return row
        await asyncio.sleep(0.025)
    raise AssertionError(f"batch {batch_id} never reached {statuses}")


async def usage_of(engine: AsyncEngine, batch_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(select(usage_records).where(usage_records.c.batch_id == batch_id))
        return [dict(r) for r in rows.mappings()]


async def output_of(services: Services, caller: Caller, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    async with services.engine.connect() as conn:
        content = await files.content(conn, caller.account_id, file_id)
    assert content is not None
    return [json.loads(line) for line in content.decode().splitlines()]


async def test_each_line_is_served_once_and_recorded_with_its_batch(engine: AsyncEngine) -> None:
    async with world(engine) as (services, caller):
        provider, = fleet(services.registry, 1, max_concurrency=3)
        batch_id = await new_batch(services, caller, 5)
        runner = BatchRunner(services)
        await runner.step()
        answered = await answer(provider, 2)  # a slot of three is kept free for live requests
        assert provider.session.active <= 2
        for _ in range(3):
            await runner.step()
            answered += await answer(provider, 1)
        done = await until(services, batch_id, "completed", runner=runner)
        assert (done["completed"], done["failed"]) == (5, 0)
        output = await output_of(services, caller, done["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in range(5)]
        assert sorted(line["response"]["request_id"] for line in output) == sorted(answered)
        rows = await usage_of(engine, batch_id)
        assert sorted(r["custom_id"] for r in rows) == [f"r{i}" for i in range(5)]
        by_request = {r["request_id"]: r["cost_micro_usd"] for r in rows}
        assert all(line["response"]["body"]["usage"]["cost_micro_usd"] == by_request[line["response"]["request_id"]]
                   for line in output)


async def test_a_line_whose_lease_was_lost_is_not_charged_and_runs_again_elsewhere(engine: AsyncEngine) -> None:
    async with world(engine) as (services, caller):
        provider, = fleet(services.registry, 1, max_concurrency=2)
        batch_id = await new_batch(services, caller, 1)
        runner = BatchRunner(services)
        await runner.step()
        request = await provider.next_request(timeout=10)
        now = int(time.time())
        async with engine.begin() as conn:  # its lease ran out and another coordinator took the line over
            await conn.execute(update(batch_lines).values(lease_until=now - 1))
            assert len(await batches.claim(conn, batch_id, "inst_other", now, now + 60, 10)) == 1
        provider.reply(request.request_id, "late")
        provider.complete(request.request_id)
        await services.drain(5)
        for _ in range(100):
            if not runner._lines.get(batch_id):
                break
            await asyncio.sleep(0.02)
        assert await usage_of(engine, batch_id) == []  # this attempt's answer was not kept: nothing charged
        async with engine.connect() as conn:
            line = (await conn.execute(select(batch_lines))).mappings().one()
        assert (line["state"], line["lease_owner"], line["attempts"]) == ("running", "inst_other", 2)


async def test_a_stopping_runner_puts_its_lines_back_at_once(engine: AsyncEngine) -> None:
    async with world(engine) as (services, caller):
        provider, = fleet(services.registry, 1, max_concurrency=4)
        batch_id = await new_batch(services, caller, 3)
        task = asyncio.ensure_future(BatchRunner(services).run_forever())
        await provider.next_request(timeout=10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await services.drain(5)
        async with engine.connect() as conn:
            states = (await conn.execute(select(batch_lines.c.state))).scalars().all()
        assert sorted(states) == ["pending"] * 3
        assert await usage_of(engine, batch_id) == []


async def test_an_expired_window_ends_the_lines_not_running_uncharged(engine: AsyncEngine) -> None:
    async with world(engine) as (services, caller):
        batch_id = await new_batch(services, caller, 3)  # no provider: nothing runs
        async with engine.begin() as conn:
            await conn.execute(update(batches.batches).values(expires_at=int(time.time()) - 1))
        done = await until(services, batch_id, "expired", runner=BatchRunner(services))
        assert done["expired_at"] is not None and done["output_file_id"] is None
        errors = await output_of(services, caller, done["error_file_id"])
        assert [(e["custom_id"], e["error"]["code"], e["response"]) for e in errors] == [
            (f"r{i}", "batch_expired", None) for i in range(3)]
        assert (done["completed"], done["failed"]) == (0, 3)
        assert await usage_of(engine, batch_id) == []


async def test_two_runners_share_a_batch_and_answer_each_line_once(engine: AsyncEngine) -> None:
    async with world(engine, batch_lines_in_flight=2) as (services, caller):
        provider, = fleet(services.registry, 1, max_concurrency=8)
        batch_id = await new_batch(services, caller, 6)
        other = Services(settings=services.settings, engine=engine, registry=services.registry,
                         rate_limiter=services.rate_limiter, instance_id="inst_second")
        first, second = BatchRunner(services), BatchRunner(other)
        stop = asyncio.Event()

        async def provider_answers() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await answer(provider, 1)

        answering = asyncio.ensure_future(provider_answers())
        try:
            for _ in range(400):
                await asyncio.gather(first.step(), second.step())
                async with engine.connect() as conn:
                    row = await batches.get(conn, None, batch_id)
                if row is not None and row["status"] == "completed":
                    break
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await answering
            await other.drain(5)
            await other.ledger.close()
        output = await output_of(services, caller, row["output_file_id"])
        assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in range(6)]
        rows = await usage_of(engine, batch_id)
        assert sorted(r["custom_id"] for r in rows) == [f"r{i}" for i in range(6)]  # each line charged once


async def test_a_key_made_self_route_only_after_creation_keeps_its_lines_off_the_fleet(engine: AsyncEngine) -> None:
    async with world(engine) as (services, console):
        async with engine.begin() as conn:
            row = await keys.create(conn, console.account_id, token_hash("dk-batch-key"), "dk-batch-k", {"name": "k"})
        caller = Caller(console.account_id, "api_key", key=ApiKey.from_row(row))
        batch_id = await new_batch(services, caller, 2)  # a fleet batch
        async with engine.begin() as conn:
            await keys.update_fields(conn, console.account_id, row["id"], {"self_route_only": True})
        stranger, = fleet(services.registry, 1, max_concurrency=4)
        runner = BatchRunner(services)
        for _ in range(10):
            await runner.step()
            await asyncio.sleep(0.02)
        assert stranger.requests() == []  # the fleet's machine is not the caller's own
        own, = fleet(services.registry, 1, max_concurrency=4, account=console.account_id)
        async with engine.begin() as conn:  # the waiting lines are tried again now
            await conn.execute(update(batch_lines).values(not_before=0))
        await runner.step()
        await answer(own, 2)
        done = await until(services, batch_id, "completed", runner=runner)
        assert done["completed"] == 2 and stranger.requests() == []
        assert [r["routed"] for r in await usage_of(engine, batch_id)] == ["owned", "owned"]
