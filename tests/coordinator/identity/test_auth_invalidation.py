"""How changes reach the AuthCache: the local drop of ``changing()`` (SQLite and Postgres), and on
Postgres the NOTIFY that another coordinator's notice listener receives, on a real database."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

import pytest
from sqlalchemy import text

from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.identity import auth_invalidation
from darkbloom.coordinator.identity.auth_cache import AuthCache, Grant, key_subject
from darkbloom.coordinator.identity.auth_invalidation import changing
from darkbloom.coordinator.money.ratelimit import MemoryRateLimiter
from darkbloom.coordinator.services import Services
from darkbloom.store import create_engine, migrate, notices


async def _services(database_url: str) -> Services:
    engine = create_engine(database_url)
    await migrate(engine)
    return Services(settings=CoordinatorSettings(database_url=database_url), engine=engine,
                    registry=Registry(), rate_limiter=MemoryRateLimiter())


@pytest.fixture
async def services(database_url: str) -> AsyncIterator[Services]:
    made = await _services(database_url)
    try:
        yield made
    finally:
        await made.engine.dispose()


@pytest.fixture
async def two(postgres_url: str) -> AsyncIterator[tuple[Services, Services]]:
    """Two coordinators' services on one Postgres database."""
    first = await _services(postgres_url)
    second = await _services(postgres_url)
    try:
        yield first, second
    finally:
        await first.engine.dispose()
        await second.engine.dispose()


async def _cached(cache: AuthCache, digest: str, key_id: str) -> None:
    async def load() -> Grant | None:
        return Grant({"id": key_id}, (key_subject(key_id),))
    await cache.get(digest, load)
    assert len(cache) >= 1


async def _still_cached(cache: AuthCache, digest: str) -> bool:
    """Whether the cache answers for ``digest`` without loading it again."""
    loaded: list[str] = []

    async def load() -> Grant | None:
        loaded.append(digest)
        return None
    await cache.get(digest, load)
    return not loaded


async def _eventually(predicate: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_changing_drops_this_process_grants_when_it_commits(services: Services) -> None:
    await _cached(services.auth_cache, "h1", "k1")
    await _cached(services.auth_cache, "h2", "k2")
    async with changing(services, key_subject("k1")) as conn:
        await conn.execute(text("SELECT 1"))
    assert len(services.auth_cache) == 1  # k2's grant stays


async def test_changing_drops_them_also_when_it_rolls_back(services: Services) -> None:
    await _cached(services.auth_cache, "h1", "k1")
    with pytest.raises(RuntimeError):
        async with changing(services, key_subject("k1")):
            raise RuntimeError("refused")
    assert len(services.auth_cache) == 0


def _listening(services: Services, **options: float) -> notices.Listener:
    """The notice listener a coordinator on Postgres runs, with the auth cache subscribed (app.py)."""
    listener = notices.Listener(services.engine, **options)
    auth_invalidation.subscribe(services, listener)
    return listener


async def test_the_cache_stores_nothing_before_the_listener_listens(two: tuple[Services, Services]) -> None:
    _, there = two
    _listening(there)
    assert not there.auth_cache.caching


async def test_a_committed_change_reaches_the_other_coordinator(two: tuple[Services, Services]) -> None:
    here, there = two
    listener = _listening(there)
    task = asyncio.create_task(listener.run())
    try:
        await _eventually(lambda: listener.listening, timeout=10)
        await _cached(there.auth_cache, "h1", "k1")
        await _cached(there.auth_cache, "h2", "k2")
        async with changing(here, key_subject("k1")) as conn:
            await conn.execute(text("SELECT 1"))
        delay = await _eventually(lambda: len(there.auth_cache) == 1, timeout=1.0)
        print(f"notice delivered after {delay * 1000:.1f} ms")
    finally:
        task.cancel()


async def test_a_rolled_back_change_sends_no_notice(two: tuple[Services, Services]) -> None:
    here, there = two
    listener = _listening(there)
    task = asyncio.create_task(listener.run())
    try:
        await _eventually(lambda: listener.listening, timeout=10)
        await _cached(there.auth_cache, "h1", "k1")
        await _cached(there.auth_cache, "h2", "k-other")
        with pytest.raises(RuntimeError):
            async with changing(here, key_subject("k1")):
                raise RuntimeError("refused")
        async with changing(here, key_subject("k-other")) as conn:  # a later notice, to wait on
            await conn.execute(text("SELECT 1"))
        await _eventually(lambda: len(there.auth_cache) < 2, timeout=10)  # the later notice arrived
        assert len(there.auth_cache) == 1 and await _still_cached(there.auth_cache, "h1")
    finally:
        task.cancel()


async def test_a_lost_listener_suspends_the_cache_until_it_listens_again(two: tuple[Services, Services]) -> None:
    here, there = two
    listener = _listening(there, reconnect_first=0.05)
    task = asyncio.create_task(listener.run())
    try:
        await _eventually(lambda: listener.listening, timeout=10)
        await _cached(there.auth_cache, "h1", "k1")
        async with here.engine.connect() as conn:  # the listening connection dies
            await conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"),
                {"name": notices.APPLICATION_NAME})
            await conn.commit()
        await _eventually(lambda: not there.auth_cache.caching, timeout=5)
        assert len(there.auth_cache) == 0
        await _eventually(lambda: listener.listening and there.auth_cache.caching, timeout=10)
        await _cached(there.auth_cache, "h1", "k1")
        async with changing(here, key_subject("k1")) as conn:  # and it hears changes again
            await conn.execute(text("SELECT 1"))
        await _eventually(lambda: len(there.auth_cache) == 0, timeout=1.0)
    finally:
        task.cancel()
