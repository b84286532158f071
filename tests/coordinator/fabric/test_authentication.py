"""Fabric messages prove who sent them, to whom, and once: a replica's key is read from the shared
database; a message with no proof, a forged or altered one, one for another replica, an old one or
a repeat is dropped and counted, and only a replica the database lists as live is believed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fabric import authentication
from darkbloom.coordinator.fabric.authentication import (EVERYONE, WINDOW, Authenticator, Rejected, ReplayWindow,
                                                         ReplicaKey, Roster)
from darkbloom.store import create_engine, migrate
from darkbloom.store.schema import coordinator_instances

SUBJECT = "t.hold.inst_b"


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
    await migrate(engine)
    yield engine
    await engine.dispose()


async def replica(engine: AsyncEngine, name: str) -> Authenticator:
    now = int(time.time())
    async with engine.begin() as conn:
        await conn.execute(insert(coordinator_instances).values(id=name, started_at=now, last_seen=now))
    roster = Roster(ReplicaKey(name), engine, stale_after=30)
    await roster.publish()
    return Authenticator(roster)


async def pair(engine: AsyncEngine) -> tuple[Authenticator, Authenticator]:
    a, b = await replica(engine, "inst_a"), await replica(engine, "inst_b")
    await a.roster.refresh()
    await b.roster.refresh()
    return a, b


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("darkbloom_fabric_dropped_total", {"reason": reason}) or 0.0


async def rejected(auth: Authenticator, subject: str, data: bytes) -> str:
    before = {reason: dropped(reason) for reason in ("unauthenticated", "not_for_us", "unknown_replica",
                                                    "bad_signature", "stale", "replayed", "own_message")}
    with pytest.raises(Rejected) as caught:
        await auth.open(subject, data)
    reason = caught.value.reason
    assert dropped(reason) == before[reason] + 1  # counted
    return reason


async def test_a_message_to_one_replica_opens_there_once(engine: AsyncEngine) -> None:
    a, b = await pair(engine)
    sealed = a.seal(SUBJECT, b"hello", "inst_b")
    assert sealed is not None
    opened = await b.open(SUBJECT, sealed)
    assert opened.sender == "inst_a" and opened.body == b"hello"
    assert await rejected(b, SUBJECT, sealed) == "replayed"


async def test_an_announcement_is_signed_for_everyone(engine: AsyncEngine) -> None:
    a, b = await pair(engine)
    c = await replica(engine, "inst_c")
    await c.roster.refresh()
    sealed = a.seal("t.fleet", b'{"replica":"inst_a"}')
    assert sealed is not None
    assert (await b.open("t.fleet", sealed)).sender == "inst_a"
    assert (await c.open("t.fleet", sealed)).sender == "inst_a"


async def test_forgeries_are_dropped(engine: AsyncEngine) -> None:
    a, b = await pair(engine)
    sealed = a.seal(SUBJECT, b"hello", "inst_b")
    assert sealed is not None
    line, body = sealed.split(b"\n", 1)
    assert await rejected(b, SUBJECT, b"hello") == "unauthenticated"
    assert await rejected(b, SUBJECT, b'{"k":"release","t":"x"}\n') == "unauthenticated"
    assert await rejected(b, SUBJECT, line + b"\nhellO") == "bad_signature"          # body altered
    assert await rejected(b, "t.hold.inst_c", sealed) == "bad_signature"            # moved to another subject
    for_c = a.seal("t.hold.inst_c", b"x", "inst_b")
    assert for_c is not None
    assert await rejected(b, "t.hold.inst_c", for_c.replace(b"inst_b", b"inst_c", 1)) == "not_for_us"
    # the attacker's own key, under a live replica's name: the MAC is not that replica's
    stranger = ReplicaKey("inst_a")
    fake_peer = authentication.Peer("inst_b", b.roster.key.signing_key.verify_key,
                                    stranger.pair_key(b.roster.key.signing_key.verify_key))
    assert await rejected(b, SUBJECT, stranger.seal(SUBJECT, b"x", "inst_b", fake_peer)) == "bad_signature"
    assert await rejected(b, "t.fleet", stranger.seal("t.fleet", b"x", EVERYONE)) == "bad_signature"
    # a name the database does not list
    nobody = ReplicaKey("inst_nobody")
    assert await rejected(b, "t.fleet", nobody.seal("t.fleet", b"x", EVERYONE)) == "unknown_replica"
    assert await rejected(b, "t.fleet", b.seal("t.fleet", b"x") or b"") == "own_message"


async def test_an_old_message_is_stale(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = await pair(engine)
    sealed = a.seal(SUBJECT, b"hello", "inst_b")
    assert sealed is not None
    later = time.time() + authentication.MAX_SKEW_MS / 1000 + 1
    monkeypatch.setattr(authentication.time, "time", lambda: later)
    assert await rejected(b, SUBJECT, sealed) == "stale"


async def test_a_replica_gone_stale_in_the_database_is_no_longer_believed(engine: AsyncEngine) -> None:
    a, b = await pair(engine)
    async with engine.begin() as conn:
        await conn.execute(update(coordinator_instances).where(coordinator_instances.c.id == "inst_a")
                           .values(last_seen=int(time.time()) - 60))
    await b.roster.refresh()
    sealed = a.seal(SUBJECT, b"hello", "inst_b")
    assert sealed is not None
    assert await rejected(b, SUBJECT, sealed) == "unknown_replica"
    assert b.seal("t.hold.inst_a", b"x", "inst_a") is None  # nothing is sent to a replica without a key


async def test_a_new_replica_is_read_from_the_database_on_its_first_message(engine: AsyncEngine) -> None:
    a, b = await pair(engine)
    b.roster._refreshed_at = float("-inf")  # its last read was long enough ago
    c = await replica(engine, "inst_c")
    await c.roster.refresh()
    sealed = c.seal(SUBJECT, b"hi", "inst_b")
    assert sealed is not None
    assert (await b.open(SUBJECT, sealed)).sender == "inst_c"


def test_the_replay_window_admits_each_sequence_once_and_nothing_too_old() -> None:
    window = ReplayWindow()
    assert window.admit(5) and window.admit(3) and not window.admit(5) and not window.admit(3)
    assert window.admit(WINDOW + 10)
    assert not window.admit(9)  # further behind the newest than the window reaches
    for seq in range(WINDOW + 11, 3 * WINDOW + 20):
        assert window.admit(seq)
    assert len(window._seen) <= 2 * WINDOW + 1 and not window.admit(3 * WINDOW)


async def test_a_restarted_replica_refuses_what_was_sent_before_it_started(engine: AsyncEngine) -> None:
    """A replica's process is new on restart: a new instance id and key, and none of the old one's
    memory of what it saw. What was sent to it before is for the old id and under the old pair's key;
    what was sent to everyone before it started is refused by its age, not by a memory it lost."""
    a, b = await pair(engine)
    to_b = a.seal(SUBJECT, b"hello", "inst_b")
    to_everyone = a.seal("t.fleet", b'{"replica":"inst_a"}')
    assert to_b is not None and to_everyone is not None
    assert (await b.open(SUBJECT, to_b)).sender == "inst_a"
    assert (await b.open("t.fleet", to_everyone)).sender == "inst_a"
    await asyncio.sleep(0.005)  # (a clock in milliseconds)
    restarted = await replica(engine, "inst_b2")  # the same coordinator, started again
    await restarted.roster.refresh()
    assert await rejected(restarted, SUBJECT, to_b) == "not_for_us"
    moved = to_b.replace(b" inst_b ", b" inst_b2 ", 1)  # addressed to the new id: not under its pair's key
    assert await rejected(restarted, SUBJECT.replace("inst_b", "inst_b2"), moved) == "bad_signature"
    assert await rejected(restarted, "t.fleet", to_everyone) == "stale"
    fresh = a.seal("t.fleet", b'{"replica":"inst_a"}')
    assert fresh is not None and (await restarted.open("t.fleet", fresh)).sender == "inst_a"
