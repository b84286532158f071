"""The machine book: registrations, heartbeats, trust changes and disconnections mark machines; the
machines table is written in batches (one statement, one transaction each), what readers see is
right before a batch commits, a failed batch is retried, and shutdown writes what is left."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.app import create_app
from darkbloom.coordinator.fleet.connection import ProviderConnection
from darkbloom.coordinator.fleet.enrollment import load_or_create_ca
from darkbloom.coordinator.fleet.machine_book import MachineBook
from darkbloom.coordinator.fleet.machines import enroll_machine, linked_machines
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.fleet.session import MACHINE_SEEN_EVERY, ProviderSession
from darkbloom.coordinator.services import Services
from darkbloom.store import accounts, machines
from darkbloom.store.machines import Seen
from darkbloom.store.schema import machines as machines_table
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.protocol import Hardware, Heartbeat
from tests.coordinator.routing.sim import SimProvider, settings
from tests.support.held_write import HeldWrite


def services_on(engine: AsyncEngine, **fields: Any) -> Services:
    return Services(settings=settings(database_url=str(engine.url), **fields), engine=engine, registry=Registry(),
                    rate_limiter=None)  # type: ignore[arg-type]


async def linked(engine: AsyncEngine, count: int, email: str = "owner@example.com") -> tuple[str, list[str]]:
    """An account with ``count`` linked machines (as the device flow leaves them: never seen)."""
    async with engine.begin() as conn:
        account_id = await accounts.create_account(conn, email, "h")
        return account_id, [await machines.create(conn, account_id, name="new machine") for _ in range(count)]


def session_of(account_id: str, machine_id: str, name: str = "") -> ProviderSession:
    """A trusted session of the machine, not yet registered, that marks nothing (another replica's)."""
    session = SimProvider(account=account_id, machine=machine_id, online=False).session
    session.registration = session.registration.model_copy(update={"name": name})
    return session


def connection_of(services: Services, account_id: str, machine_id: str, name: str = "") -> ProviderConnection:
    """The connection of a trusted session of the machine held here, not yet registered (as
    ``ProviderConnection.open`` leaves it); its socket is never read or written."""
    connection = ProviderConnection(services, websocket=None)  # type: ignore[arg-type]
    node = session_of(account_id, machine_id, name)
    connection.session = ProviderSession(
        id=node.id, account_id=account_id, machine_id=machine_id, registration=node.registration,
        public_key=node.public_key, link=connection, trust_level="self_signed", runtime_verified=True,
        challenge_passed_at=node.challenge_passed_at, book=services.machine_book)
    return connection


def registered(services: Services, account_id: str, machine_id: str, name: str = "") -> ProviderConnection:
    connection = connection_of(services, account_id, machine_id, name)
    connection.complete_registration()
    return connection


def node(connection: ProviderConnection) -> ProviderSession:
    assert connection.session is not None
    return connection.session


async def row(engine: AsyncEngine, machine_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        found = await machines.get(conn, machine_id)
    assert found is not None
    return found


@dataclass
class Counted:
    """Every statement the engine sends and every transaction it begins."""

    statements: list[str] = field(default_factory=list)
    transactions: int = 0


def count(engine: AsyncEngine) -> tuple[Counted, Callable[[], None]]:
    counted = Counted()

    def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        counted.statements.append(statement)

    def on_begin(_conn: Any) -> None:
        counted.transactions += 1

    event.listen(engine.sync_engine, "before_cursor_execute", on_statement)
    event.listen(engine.sync_engine, "begin", on_begin)

    def stop() -> None:
        event.remove(engine.sync_engine, "before_cursor_execute", on_statement)
        event.remove(engine.sync_engine, "begin", on_begin)

    return counted, stop


async def fleet_bookkeeping(engine: AsyncEngine, size: int) -> tuple[Counted, int, int]:
    """``size`` sessions register, heartbeat three times (each heartbeat due to mark, as a minute
    apart), one in two is distrusted, all disconnect; the book is flushed after each phase. Returns
    what the database was sent, the flushes and the rows they wrote."""
    services = services_on(engine)
    account_id, machine_ids = await linked(engine, size, email=f"fleet-{size}@example.com")
    connections = [connection_of(services, account_id, machine_id) for machine_id in machine_ids]
    counted, stop = count(engine)
    try:
        for connection in connections:
            connection.complete_registration()
        assert counted.statements == [], "registration wrote to the database itself"
        await services.machine_book.flush()
        for _ in range(3):
            for connection in connections:
                assert connection.session is not None
                connection.session.machine_seen_at -= MACHINE_SEEN_EVERY
                connection.session.heartbeat(Heartbeat())
            await services.machine_book.flush()
        for connection in connections[::2]:
            assert connection.session is not None
            connection.session.distrust("a test said so")
        for connection in connections:
            connection.close()
        await services.machine_book.flush()
    finally:
        stop()
    return counted, services.machine_book.flushes, services.machine_book.rows


async def test_database_work_follows_the_flushes_not_the_fleet(engine: AsyncEngine) -> None:
    small, small_flushes, small_rows = await fleet_bookkeeping(engine, 10)
    large, large_flushes, large_rows = await fleet_bookkeeping(engine, 200)
    assert small_flushes == large_flushes == 5  # registration, three heartbeat rounds, the disconnections
    assert small.transactions == large.transactions == small_flushes
    # registration marks every machine; a heartbeat that says nothing new, and a disconnection of a machine
    # whose session said nothing new since, touch its last seen time alone; a distrusted one is marked
    assert [_kind(s) for s in small.statements] == [_kind(s) for s in large.statements] \
        == ["mark", "touch", "touch", "touch", "mark", "touch"]
    assert (small_rows, large_rows) == (5 * 10, 5 * 200)  # every machine in every batch


def _kind(statement: str) -> str:
    assert statement.lstrip().upper().startswith("UPDATE MACHINES"), statement
    return "mark" if "trust_level" in statement else "touch"


async def test_rows_are_what_the_sessions_said_right_after_a_flush(engine: AsyncEngine) -> None:
    services = services_on(engine)
    account_id, [kept, distrusted] = await linked(engine, 2)
    first, second = registered(services, account_id, kept, name="desk"), registered(services, account_id, distrusted)
    assert (await row(engine, kept))["last_seen"] is None  # marked, not written yet
    await services.machine_book.flush()
    stored = await row(engine, kept)
    assert (stored["name"], stored["models"], stored["trust_level"], stored["private_only"],
            stored["identity_key"]) == ("desk", sorted(node(first).advertised_models), "self_signed", False,
                                        node(first).registration.identity_key)
    registered_at = stored["last_seen"]
    assert registered_at is not None

    node(second).distrust("a test said so")
    first.close()
    await services.machine_book.flush()
    assert (await row(engine, distrusted))["trust_level"] == "untrusted"
    stored = await row(engine, kept)
    assert (stored["name"], stored["trust_level"]) == ("desk", "self_signed")
    assert stored["last_seen"] >= registered_at
    assert not services.machine_book.pending(kept) and not services.machine_book.pending(distrusted)


async def test_listings_show_what_is_marked_before_it_is_written(engine: AsyncEngine) -> None:
    services = services_on(engine)
    account_id, [machine_id] = await linked(engine, 1)
    connection = connection_of(services, account_id, machine_id, name="desk")
    session = node(connection)
    session.registration = session.registration.model_copy(
        update={"hardware": Hardware(device="metal", backend="llama-cpp")})
    connection.complete_registration()
    [listed] = await linked_machines(services, account_id)
    assert (listed["online"], listed["session_id"], listed["name"], listed["trust_level"]) == \
        (True, session.id, "desk", "self_signed")
    assert listed["last_seen"] is not None
    assert (listed["device"], listed["backend"]) == ("metal", "llama-cpp")  # where it runs its models

    session.distrust("a test said so")
    connection.close()
    [listed] = await linked_machines(services, account_id)
    assert (listed["online"], listed["name"], listed["trust_level"], listed["models"]) == \
        (False, "desk", "untrusted", sorted(session.advertised_models))
    assert (listed["device"], listed["backend"]) == (None, None)  # known only while it is online
    assert (await row(engine, machine_id))["last_seen"] is None  # all of it from the book so far


async def test_a_machine_registered_on_another_replica_can_be_enrolled_before_it_is_written(
        engine: AsyncEngine) -> None:
    services = services_on(engine)
    account_id, [machine_id] = await linked(engine, 1)
    stand_in = session_of(account_id, machine_id)  # announced by the replica that holds it, unwritten there
    stand_in.mark_online()
    services.registry.add_stand_in(stand_in)
    assert (await row(engine, machine_id))["identity_key"] is None
    enrolled = await enroll_machine(services, machine_id)
    ca = await load_or_create_ca(engine)
    assert ca.verify(enrolled["certificate"], stand_in.registration.identity_key) is None

    services.registry.remove(stand_in)  # gone, and nothing ever written: nothing to certify
    _, [never_seen] = await linked(engine, 1, email="other@example.com")
    with pytest.raises(ApiError) as refused:
        await enroll_machine(services, never_seen)
    assert refused.value.code == "machine_not_registered"


async def test_the_flusher_writes_every_mark_of_a_round_in_one_batch(engine: AsyncEngine) -> None:
    services = services_on(engine, machine_flush_interval=0.01)
    account_id, machine_ids = await linked(engine, 20)
    book = services.machine_book
    book.start()
    try:
        for machine_id in machine_ids:
            registered(services, account_id, machine_id)
        while any(book.pending(m) for m in machine_ids):
            await asyncio.sleep(0.01)
    finally:
        await book.close()
    assert (book.flushes, book.rows) == (1, 20)
    assert all([(await row(engine, m))["last_seen"] is not None for m in machine_ids])


async def test_a_failed_batch_is_retried_and_a_newer_mark_wins(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    services = services_on(engine, machine_flush_interval=0.01)
    account_id, [machine_id] = await linked(engine, 1)
    write = machines.record_seen
    failures = 2

    async def failing(conn: Any, seen: Any) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionError("database gone")
        await write(conn, seen)

    monkeypatch.setattr(machines, "record_seen", failing)
    book = services.machine_book
    session = node(registered(services, account_id, machine_id))
    with pytest.raises(ConnectionError):
        await book.flush()
    assert book.pending(machine_id) and book.flushes == 0  # kept for the next round

    session.distrust("a test said so")  # newer than the failed batch
    caplog.set_level(logging.WARNING, "darkbloom.machines")
    book.start()
    try:
        while book.pending(machine_id):
            await asyncio.sleep(0.01)
    finally:
        await book.close()
    assert failures == 0 and book.flushes == 1
    assert "could not record 1 machines" in caplog.text and "database gone" in caplog.text
    assert (await row(engine, machine_id))["trust_level"] == "untrusted"


async def test_shutdown_writes_what_is_still_marked(database_url: str, engine: AsyncEngine) -> None:
    account_id, [machine_id] = await linked(engine, 1)
    app = create_app(settings(database_url=database_url, machine_flush_interval=3600.0))
    async with app.router.lifespan_context(app):
        services: Services = app.state.services
        session = node(registered(services, account_id, machine_id, name="desk"))
        session.distrust("a test said so")
        assert services.registry.get(session.id) is session
        assert (await row(engine, machine_id))["last_seen"] is None  # an hour to the first batch
    assert services.registry.get(session.id) is None  # the lifespan closed it
    stored = await row(engine, machine_id)
    assert (stored["name"], stored["trust_level"]) == ("desk", "untrusted") and stored["last_seen"] is not None


async def test_stopping_waits_for_a_write_under_way_rather_than_cancelling_it(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction cancelled mid-statement can stay open on the server, holding the rows the last
    write at shutdown needs (a shutdown that hung until the process was killed)."""
    _account, [machine_id] = await linked(engine, 1)
    book = MachineBook(engine, interval=0.01)
    held = HeldWrite(machines.record_seen)
    monkeypatch.setattr(machines, "record_seen", held)
    book.start()
    book.mark(machine_id, machines.Seen(last_seen=1_800_000_000, models=["m"], trust_level="none", private_only=False))
    await asyncio.wait_for(held.entered.wait(), 5)
    closing = asyncio.ensure_future(book.close())
    await asyncio.sleep(0.05)
    assert not closing.done()
    held.release.set()
    await asyncio.wait_for(closing, 5)
    assert held.outcomes == ["done"]
    async with engine.connect() as conn:
        assert (await machines.get(conn, machine_id))["last_seen"] == 1_800_000_000


async def test_unchanged_heartbeats_wait_for_the_next_mark(engine: AsyncEngine) -> None:
    """A heartbeat the reader has just judged mutes its repeats until the machine is due to be marked
    again, so the one delivered after the mute marks it (and one that marks it mutes a whole period)."""
    services = services_on(engine)
    account_id, [machine_id] = await linked(engine, 1)
    session = node(registered(services, account_id, machine_id))
    every = MACHINE_SEEN_EVERY
    assert every - 1 < session.unchanged_heartbeats_idle_for() <= every
    session.machine_seen_at -= every - 20  # marked 40 s ago: due in 20
    assert 19 < session.unchanged_heartbeats_idle_for() <= 20
    session.machine_seen_at -= 20  # due now: this heartbeat marks it
    assert session.unchanged_heartbeats_idle_for() == every
    seen_before = session.machine_seen_at
    session.heartbeat(Heartbeat())
    assert session.machine_seen_at > seen_before
    assert every - 1 < session.unchanged_heartbeats_idle_for() <= every


async def test_a_touch_writes_the_last_seen_time_alone(engine: AsyncEngine) -> None:
    """A touch moves only ``last_seen`` (what another writer set meanwhile stays), readers see it before it
    is written, and a touch of a machine whose mark is still pending moves that mark's time instead."""
    book = MachineBook(engine, interval=60)
    account_id, [touched, marked] = await linked(engine, 2)
    seen = Seen(last_seen=1_000, models=["m"], trust_level="self_signed", private_only=False, name="desk")
    book.mark(touched, seen)
    await book.flush()
    async with engine.begin() as conn:  # another replica's write, after ours
        await conn.execute(update(machines_table).where(machines_table.c.id == touched).values(
            trust_level="hardware"))
    book.touch(touched, 2_000)
    assert book.pending(touched)
    listed = book.current(await row(engine, touched))
    assert (listed["last_seen"], listed["trust_level"]) == (2_000, "hardware")
    book.mark(marked, seen)
    book.touch(marked, 3_000)  # before the mark was written
    await book.flush()
    assert not book.pending(touched) and not book.pending(marked)
    stored, other = await row(engine, touched), await row(engine, marked)
    assert (stored["last_seen"], stored["trust_level"], stored["models"], stored["name"]) \
        == (2_000, "hardware", ["m"], "desk")
    assert (other["last_seen"], other["trust_level"], other["name"]) == (3_000, "self_signed", "desk")


async def test_a_failed_touch_is_kept_and_a_newer_one_wins(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    book = MachineBook(engine, interval=60)
    account_id, [kept, overtaken] = await linked(engine, 2)
    for machine_id in (kept, overtaken):
        book.mark(machine_id, Seen(last_seen=1_000, models=[], trust_level="none", private_only=False))
    await book.flush()
    write = machines.record_last_seen

    async def failing(conn: Any, last_seen: Any) -> None:
        monkeypatch.setattr(machines, "record_last_seen", write)
        raise ConnectionError("database gone")

    monkeypatch.setattr(machines, "record_last_seen", failing)
    book.touch(kept, 2_000)
    book.touch(overtaken, 2_000)
    with pytest.raises(ConnectionError):
        await book.flush()
    assert book.pending(kept) and book.pending(overtaken)
    assert book.current(await row(engine, kept))["last_seen"] == 2_000
    book.touch(overtaken, 3_000)
    await book.flush()
    assert [(await row(engine, m))["last_seen"] for m in (kept, overtaken)] == [2_000, 3_000]


async def test_readers_see_a_touch_made_while_a_mark_is_written(engine: AsyncEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    book = MachineBook(engine, interval=60)
    account_id, [machine_id] = await linked(engine, 1)
    held = HeldWrite(machines.record_seen)
    monkeypatch.setattr(machines, "record_seen", held)
    book.mark(machine_id, Seen(last_seen=1_000, models=["m"], trust_level="self_signed", private_only=False))
    writing = asyncio.ensure_future(book.flush())
    await asyncio.wait_for(held.entered.wait(), 5)
    book.touch(machine_id, 2_000)  # after the batch left: the next one carries it
    listed = book.current(await row(engine, machine_id))
    assert (listed["last_seen"], listed["trust_level"], listed["models"]) == (2_000, "self_signed", ["m"])
    held.release.set()
    await asyncio.wait_for(writing, 5)
    assert book.pending(machine_id)
    await book.flush()
    assert (await row(engine, machine_id))["last_seen"] == 2_000


async def test_a_failed_mark_takes_the_time_of_a_touch_made_during_its_write(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    book = MachineBook(engine, interval=60)
    account_id, [machine_id] = await linked(engine, 1)
    write, entered, release = machines.record_seen, asyncio.Event(), asyncio.Event()

    async def failing(conn: Any, seen: Any) -> None:
        entered.set()
        await release.wait()
        raise ConnectionError("database gone")

    monkeypatch.setattr(machines, "record_seen", failing)
    book.mark(machine_id, Seen(last_seen=1_000, models=["m"], trust_level="self_signed", private_only=False))
    writing = asyncio.ensure_future(book.flush())
    await asyncio.wait_for(entered.wait(), 5)
    book.touch(machine_id, 2_000)
    release.set()
    with pytest.raises(ConnectionError):
        await writing
    assert book.current(await row(engine, machine_id))["last_seen"] == 2_000  # the mark kept, with the newer time
    monkeypatch.setattr(machines, "record_seen", write)
    await book.flush()
    stored = await row(engine, machine_id)
    assert (stored["last_seen"], stored["trust_level"], stored["models"]) == (2_000, "self_signed", ["m"])
    assert not book.pending(machine_id)
