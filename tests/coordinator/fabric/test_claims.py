"""A claim on another replica's session is decided by its holder alone. Two in-process replicas on the
machine's NATS (their real connections, a subject prefix of their own) and a raw nats-py client with
no key that answers every claim on the holder first — with garbage, with a bare answer, with a proof
line posing as the holder (at a fresh and at a huge sequence number) and with the holder's real answer
to an earlier claim: the admitting replica waits past them for the holder's own answer. A claim the
admitting replica gave up on is released on the holder, whether its release comes after the claim
or before it."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from darkbloom.coordinator.fabric import messages, remote_link
from darkbloom.coordinator.fleet.session import ProviderSession
from tests.coordinator.fabric.inprocess import Bus, Replica, make_replica
from tests.support.replicas import NATS_URL, subject_prefix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

HUGE_SEQ = 1 << 62


def dropped() -> dict[str, float]:
    return {reason: REGISTRY.get_sample_value("darkbloom_fabric_dropped_total", {"reason": reason}) or 0.0
            for reason in ("unauthenticated", "bad_signature", "replayed", "impersonation")}


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.01)


def forged_proof(sender: str, to: str, seq: int) -> bytes:
    tag = base64.b64encode(secrets.token_bytes(32))
    return b"DBA1 %s %s %d %d %s\n" % (sender.encode(), to.encode(), seq, int(time.time() * 1000), tag)


@dataclass
class Forger:
    """Answers every claim on the holder's subject at once, five ways, before the holder can; and
    keeps the holder's real answers (it hears every inbox) to send again to the next claim."""

    nc: Client
    holder: str
    claimant: str
    claims: int = 0
    answers: int = 0
    real: list[bytes] = field(default_factory=list)

    async def on_claim(self, msg: Any) -> None:
        self.claims += 1
        if not msg.reply:
            return
        busy = messages.claim_reply(False, "busy")
        forged = [b"\x00garbage", busy, forged_proof(self.holder, self.claimant, 1 << 20) + busy,
                  forged_proof(self.holder, self.claimant, HUGE_SEQ) + busy]
        forged += self.real[-1:]  # the holder's answer to the last claim: its MAC names another inbox
        for answer in forged:
            await self.nc.publish(msg.reply, answer)
        self.answers += len(forged)
        await self.nc.flush()

    async def on_inbox(self, msg: Any) -> None:
        if bytes(msg.data).startswith(b"DBA1 %s " % self.holder.encode()):
            self.real.append(bytes(msg.data))


@dataclass
class World:
    a: Replica  # holds the session
    b: Replica  # admits the requests
    spy: Client
    claim_delay: float = 0.0  # before A's holder takes up a claim (its claims' subscription is behind)
    reply_delay: float = 0.0  # before A's answer leaves (its answer is late)
    claims_taken_up: int = 0

    def session(self, **options: Any) -> ProviderSession:
        return self.a.add(1, **options)[0].session

    async def stand_in(self, session: ProviderSession) -> ProviderSession:
        await until(lambda: self.b.registry.get(session.id) is not None, "B seeing A's session")
        stand_in = self.b.registry.get(session.id)
        assert stand_in is not None
        return stand_in

    async def forger(self) -> Forger:
        forger = Forger(self.spy, self.a.id, self.b.id)
        await self.spy.subscribe(self.a.fabric.subjects.my_claims, cb=forger.on_claim)
        await self.spy.subscribe("_INBOX.>", cb=forger.on_inbox)
        await self.spy.flush()
        return forger


def slow(delay: Callable[[], float], handle: Callable[..., Awaitable[None]],
         done: Callable[[], None] = lambda: None) -> Callable[..., Awaitable[None]]:
    async def handled(*args: Any) -> None:
        if delay() > 0:
            await asyncio.sleep(delay())
        await handle(*args)
        done()
    return handled


@pytest.fixture
async def world() -> AsyncIterator[World]:
    bus = Bus()  # only introduces the replicas to each other: the messages go through the real server
    prefix = subject_prefix()
    a = make_replica(bus, heartbeat=0.2, url=NATS_URL, nats_subject_prefix=prefix)
    b = make_replica(bus, heartbeat=0.2, url=NATS_URL, nats_subject_prefix=prefix)
    spy = await nats.connect(NATS_URL, name="forger", no_echo=True, connect_timeout=5)
    w = World(a, b, spy)

    def taken_up() -> None:
        w.claims_taken_up += 1
    on_claim = slow(lambda: w.claim_delay, a.fabric.holder.on_claim, taken_up)
    a.fabric.holder.on_claim = on_claim  # type: ignore[method-assign]
    reply = a.fabric.connection.reply

    def late_reply(msg: Any, data: bytes, to: str) -> None:
        asyncio.get_running_loop().call_later(w.reply_delay, reply, msg, data, to)
    a.fabric.connection.reply = late_reply  # type: ignore[method-assign]
    tasks = [asyncio.ensure_future(r.fabric.connection.run(r.fabric._subscribe)) for r in (a, b)]
    try:
        await until(lambda: a.fabric.connected and b.fabric.connected, "both replicas connected")
        yield w
    finally:
        for task in tasks:
            task.cancel()
        for replica in (a, b):
            replica.close()
            await replica.fabric.connection.close()
        await spy.close()


async def test_forged_answers_to_a_claim_do_not_end_it(world: World) -> None:
    w = world
    session = w.session(max_concurrency=2)
    stand_in = await w.stand_in(session)
    forger = await w.forger()
    w.reply_delay = 0.05  # the holder's answer comes after every forged one
    before = dropped()
    for n in range(6):
        slot = w.b.registry.slots.claim(stand_in)
        assert await stand_in.link.confirm(slot.ticket), f"claim {n} refused"
        assert set(w.a.fabric.holder.hosted) == {slot.ticket} and session.active == 1
        slot.release()
        await until(lambda: not w.a.fabric.holder.hosted, "A releasing the slot")
    assert forger.claims == 6 and len(forger.real) == 6
    assert session.active == 0
    after = dropped()
    # garbage and the bare answer: no proof; the posing ones and the earlier real answer: no valid MAC
    assert after["unauthenticated"] - before["unauthenticated"] >= 12
    assert after["bad_signature"] - before["bad_signature"] >= 12 + 5
    assert after["replayed"] == before["replayed"]


async def test_a_claim_answered_too_late_is_released_on_the_holder(world: World,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    w = world
    monkeypatch.setattr(remote_link, "CLAIM_TIMEOUT", 0.2)
    session = w.session(max_concurrency=2)
    stand_in = await w.stand_in(session)
    w.reply_delay = 0.5
    slot = w.b.registry.slots.claim(stand_in)
    assert not await stand_in.link.confirm(slot.ticket)  # no answer in time: B gives up
    slot.release()
    await until(lambda: not w.a.fabric.holder.hosted and session.active == 0, "A releasing the slot", timeout=1.5)
    await asyncio.sleep(0.6)  # A's late answer, ignored
    assert not w.a.fabric.holder.hosted and session.active == 0


async def test_a_claim_that_comes_after_its_release_takes_no_slot(world: World,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    w = world
    monkeypatch.setattr(remote_link, "CLAIM_TIMEOUT", 0.2)
    session = w.session(max_concurrency=2)
    stand_in = await w.stand_in(session)
    w.claim_delay = 0.5  # A takes the claim up after B gave up on it and released it
    slot = w.b.registry.slots.claim(stand_in)
    assert not await stand_in.link.confirm(slot.ticket)
    slot.release()
    await until(lambda: w.claims_taken_up == 1, "A taking the claim up")
    assert not w.a.fabric.holder.hosted and session.active == 0
    w.claim_delay = 0.0
    slot = w.b.registry.slots.claim(stand_in)  # and the next claim is served as usual
    assert await stand_in.link.confirm(slot.ticket)
    assert set(w.a.fabric.holder.hosted) == {slot.ticket}
    slot.release()
    await until(lambda: not w.a.fabric.holder.hosted and session.active == 0, "A releasing the slot")
