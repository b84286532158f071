"""The request lifecycle gives back exactly what a request did not use, on every end: refused,
success, failure before first content, failure after it, client disconnect, cancellation.

Each test takes real rate charges (a memory limiter with key RPM/ITPM/OTPM limits), a real
reservation on the test database and a real slot on a simulated provider session, then ends the
request one way and checks the buckets, the ledger and the slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, AsyncIterator, Sequence

import pytest
from sqlalchemy import select

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.disconnect import ClientDisconnected
from darkbloom.coordinator.inference.attempts import Attempt, Attempts
from darkbloom.coordinator.inference.calls import Deadlines, TokenBounds
from darkbloom.coordinator.inference.failures import ProviderFailure
from darkbloom.coordinator.inference.settlement import RequestLifecycle
from darkbloom.coordinator.money import admission, billing
from darkbloom.coordinator.money.admission import take_request
from darkbloom.coordinator.money.ratelimit import Charge, Decision, MemoryRateLimiter
from darkbloom.coordinator.routing.decision import Policy
from darkbloom.coordinator.routing.scheduler import try_place
from darkbloom.coordinator.services import Services
from darkbloom.store.schema import reservations, usage_records
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.edges import CHAT
from darkbloom.wire.openai.presenters import ChatPresenter
from tests.coordinator.money.conftest import MakeServices, make_services, new_account, new_key, pockets  # noqa: F401 (fixture)
from tests.coordinator.routing.sim import MODEL, RUNTIME, SimProvider, chat, decision, dispatched, fleet

CREDIT = 1_000_000
PROMPT_BOUND, OUTPUT_BOUND = 400, 64
DEADLINES = Deadlines(idle=10.0, until=float("inf"))
RPM_ONLY = Counter({"requests": 1, "input_tokens": 0, "output_tokens": 0})  # what a request that used nothing keeps


class CountingLimiter(MemoryRateLimiter):
    """A real memory limiter that also keeps the net amount held per dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.held: Counter[str] = Counter()

    async def acquire(self, charges: Sequence[Charge]) -> Decision:
        decision_ = await super().acquire(charges)
        if decision_.allowed:
            for charge in charges:
                self.held[charge.bucket.dimension] += charge.amount
        return decision_

    async def refund(self, charges: Sequence[Charge]) -> None:
        await super().refund(charges)
        for charge in charges:
            self.held[charge.bucket.dimension] -= charge.amount


class World:
    def __init__(self, services: Services, caller: Caller, provider: SimProvider) -> None:
        self.services, self.caller, self.provider = services, caller, provider
        self.limiter: CountingLimiter = services.rate_limiter  # type: ignore[assignment]

    def lifecycle(self, request_id: str) -> RequestLifecycle:
        return RequestLifecycle(self.services, self.caller, request_id, CHAT.path)

    async def admit_and_place(self, life: RequestLifecycle) -> Attempts:
        await life.take_request()
        route = decision()
        await life.admit(Policy("public", None), route, TokenBounds(PROMPT_BOUND, OUTPUT_BOUND, 0))
        placement = try_place(self.services.registry, route, self.services.settings)
        assert placement is not None
        life.hold(placement.slot)
        self.first = placement
        return Attempts(life, route, "chat", chat().node_body(OUTPUT_BOUND))

    async def dispatched(self, life: RequestLifecycle) -> asyncio.Task[tuple[Attempt, bool]]:
        """Admit and place the request, run its attempts; returns once the provider has the request."""
        attempts = await self.admit_and_place(life)
        run = asyncio.ensure_future(attempts.run(self.first))
        await self.provider.next_request()
        return run

    async def served(self, life: RequestLifecycle) -> None:
        """Dispatch the request and let the provider answer it in full (one chunk, then complete)."""
        run = await self.dispatched(life)
        self.provider.reply(life.request_id)
        self.provider.complete(life.request_id)
        pending, completed = await run
        await pending.collect(completed, ChatPresenter(life.request_id, MODEL.id, {}), DEADLINES)

    async def assert_refunded(self, request_id: str) -> None:
        """The reservation went back and every rate charge but the request itself."""
        assert await self.reservation_state(request_id) == "refunded"
        assert self.limiter.held == RPM_ONLY

    async def reservation_state(self, request_id: str) -> str | None:
        async with self.services.engine.connect() as conn:
            return (await conn.execute(select(reservations.c.status)
                                       .where(reservations.c.request_id == request_id))).scalar()

    async def usage_rows(self, request_id: str) -> list[Any]:
        async with self.services.engine.connect() as conn:
            return list((await conn.execute(select(usage_records)
                                            .where(usage_records.c.request_id == request_id))).mappings())


@pytest.fixture
async def world(make_services: MakeServices) -> AsyncIterator[World]:
    services = await make_services(min_trust="self_signed", runtime_allow_list=frozenset({RUNTIME}),
                                   first_content_timeout=5.0, cancel_grace=2.0)
    services.rate_limiter = CountingLimiter()
    account = await new_account(services, credit=CREDIT)
    key = await new_key(services, account, rpm_limit=100, itpm_limit=100_000, otpm_limit=100_000)
    provider, = fleet(services.registry, 1)
    yield World(services, Caller(account_id=account, kind="api_key", key=key), provider)
    # each lifecycle counted in once and out once, however it ended (the ledger's `quiet` reads it)
    assert services.requests_in_flight == 0


async def _end(life: RequestLifecycle) -> None:
    await life.services.drain(timeout=10)


async def test_refused_gives_back_the_token_charges_and_keeps_the_rpm_charge(world: World) -> None:
    life = world.lifecycle("req-refused")
    with pytest.raises(ApiError):
        async with life:
            await take_request(world.services, world.caller)
            await life.charge_rates(admission.token_charges(world.services, world.caller, PROMPT_BOUND, OUTPUT_BOUND))
            assert world.limiter.held == Counter({"requests": 1, "input_tokens": PROMPT_BOUND,
                                                  "output_tokens": OUTPUT_BOUND})
            raise ApiError(402, "insufficient_funds", "broke")
    assert world.limiter.held == RPM_ONLY
    assert await world.reservation_state("req-refused") is None


async def test_success_settles_and_frees_the_slot(world: World) -> None:
    life = world.lifecycle("req-ok")
    async with life:
        await world.served(life)  # 3 prompt + 1 completion tokens
        assert world.provider.session.active == 1
    assert world.provider.session.active == 0
    assert await world.reservation_state("req-ok") == "settled"
    rows = await world.usage_rows("req-ok")
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == 3 and rows[0]["cost_micro_usd"] > 0
    assert world.limiter.held == Counter({"requests": 1, "input_tokens": 3, "output_tokens": 1})
    balance, _ = await pockets(world.services, world.caller.account_id)
    assert balance == CREDIT - rows[0]["cost_micro_usd"]


async def test_finish_settles_once_and_gives_the_usage_rows_cost(world: World) -> None:
    """A non-streamed answer settles before its body: ``finish`` returns what the usage row says was
    charged, and neither a second ``finish`` nor the lifecycle's exit settles again."""
    life = world.lifecycle("req-cost")
    async with life:
        await world.served(life)
        cost = await life.finish("ok")
        rows = await world.usage_rows("req-cost")  # committed before the answer is made
        assert len(rows) == 1 and cost == rows[0]["cost_micro_usd"] > 0
        assert await life.finish("ok") == cost
    assert len(await world.usage_rows("req-cost")) == 1
    assert world.provider.session.active == 0
    assert (await pockets(world.services, world.caller.account_id))[0] == CREDIT - cost


async def test_finish_leaves_the_requests_line_for_after_the_answer(world: World,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``finish`` settles without writing the request's line, so the answer's bytes need not wait for
    it; ``write_log`` writes it once they have gone, and only once. (A request that ends any other way
    is logged as it ends: the client-disconnect test below.)"""
    caplog.set_level(logging.INFO, "darkbloom.completions")
    life = world.lifecycle("req-line")
    async with life:
        await world.served(life)
        await life.finish("ok")
    assert "req-line" not in caplog.text
    life.write_log()
    life.write_log()
    assert caplog.text.count("request_id=req-line ") == 1
    assert "outcome=ok prompt_tokens=3 completion_tokens=1" in caplog.text

    broken = world.lifecycle("req-line-broken")  # finished, then no answer: the line is written on the way out
    with pytest.raises(RuntimeError):
        async with broken:
            await world.served(broken)
            await broken.finish("ok")
            raise RuntimeError("the answer could not be made")
    assert caplog.text.count("request_id=req-line-broken ") == 1


async def test_a_settlement_whose_reply_was_lost_still_gives_the_rows_cost(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first settlement commits but its caller sees an error (a reply lost on the way back): the
    retry finds the request settled, and the answer's cost is read back from the usage row, not 0."""
    real = billing.settle_bill
    calls = 0

    async def commit_then_fail(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        settled = await real(*args)
        if calls == 1:
            raise ConnectionError("reply lost after the commit")
        return settled

    monkeypatch.setattr(billing, "settle_bill", commit_then_fail)
    life = world.lifecycle("req-lost-reply")
    async with life:
        await world.served(life)
        cost = await life.finish("ok")
    rows = await world.usage_rows("req-lost-reply")
    assert calls == 2 and len(rows) == 1 and cost == rows[0]["cost_micro_usd"] > 0


async def test_a_request_that_failed_after_first_content_finishes_at_no_cost(world: World) -> None:
    life = world.lifecycle("req-cost-broke")
    async with life:
        run = await world.dispatched(life)
        world.provider.reply("req-cost-broke")
        pending, completed = await run
        world.provider.error("req-cost-broke", 500, "crashed")
        with pytest.raises(ProviderFailure):
            await pending.collect(completed, ChatPresenter("req-cost-broke", MODEL.id, {}), DEADLINES)
        assert await life.finish("provider_error") == 0
    await world.assert_refunded("req-cost-broke")


async def test_failure_before_first_content_refunds_and_keeps_the_rpm_charge(world: World) -> None:
    life = world.lifecycle("req-unserved")
    with pytest.raises(ProviderFailure):
        async with life:
            run = await world.dispatched(life)
            world.provider.error("req-unserved", 400, "bad request")  # not retryable
            await run
    assert world.provider.session.active == 0
    await world.assert_refunded("req-unserved")
    assert await world.usage_rows("req-unserved") == []
    assert (await pockets(world.services, world.caller.account_id))[0] == CREDIT


async def test_failure_after_first_content_refunds_the_reservation(world: World) -> None:
    life = world.lifecycle("req-broke")
    with pytest.raises(ProviderFailure):
        async with life:
            run = await world.dispatched(life)
            world.provider.reply("req-broke")
            pending, completed = await run
            world.provider.error("req-broke", 500, "crashed")
            await pending.collect(completed, ChatPresenter("req-broke", MODEL.id, {}), DEADLINES)
    assert world.provider.session.active == 0
    await world.assert_refunded("req-broke")
    assert await world.usage_rows("req-broke") == []


async def test_client_disconnect_after_first_content_stops_the_provider_and_charges_its_usage(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "darkbloom.completions")
    life = world.lifecycle("req-gone")
    with pytest.raises(ClientDisconnected):
        async with life:
            run = await world.dispatched(life)
            world.provider.reply("req-gone")
            await run
            raise ClientDisconnected()
    cancel = await world.provider.next_frame()  # the lifecycle told the provider to stop …
    assert type(cancel).__name__ == "Cancel" and cancel.request_id == "req-gone"
    world.provider.complete("req-gone")  # … and it reports what it used
    await _end(life)
    assert caplog.text.count("request_id=req-gone ") == 1 and "outcome=client_disconnected " in caplog.text
    assert world.provider.session.active == 0
    assert await world.reservation_state("req-gone") == "settled"
    assert len(await world.usage_rows("req-gone")) == 1


async def test_cancellation_before_first_content_releases_every_attempt(world: World) -> None:
    life = world.lifecycle("req-cancelled")
    second, = fleet(world.services.registry, 1)

    async def request() -> None:
        async with life:
            attempts = await world.admit_and_place(life)
            await attempts.run(world.first)

    task = asyncio.ensure_future(request())
    primary = await dispatched([world.provider, second], timeout=10)
    assert world.first.session is primary.session
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _end(life)
    assert world.provider.session.active == second.session.active == 0
    assert primary.cancels() == ["req-cancelled"]
    await world.assert_refunded("req-cancelled")
