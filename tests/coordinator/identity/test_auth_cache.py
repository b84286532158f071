"""AuthCache on its own: a loader that counts its calls stands in for the database."""

from __future__ import annotations

import asyncio

import pytest

from darkbloom.coordinator.identity.auth_cache import AuthCache, Grant, key_subject


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Table:
    """token hash → grant, as the database would answer; ``loads`` counts the lookups."""

    def __init__(self) -> None:
        self.rows: dict[str, Grant] = {}
        self.loads = 0
        self.gate: asyncio.Event | None = None  # when set, a lookup waits for it (a slow database)

    def loader(self, digest: str):  # type: ignore[no-untyped-def]
        async def load() -> Grant | None:
            self.loads += 1
            answer = self.rows.get(digest)  # read now: what the database held when the query ran
            if self.gate is not None:
                await self.gate.wait()
            return answer
        return load

    async def started(self, count: int) -> None:
        """Until ``count`` lookups have started (each has read its row, then waits on ``gate``): a
        lookup starts within a loop turn or two of its request."""
        for _ in range(100):
            if self.loads >= count:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{self.loads} lookups started, not {count}")


def key(key_id: str, limit: int | None = None, expires_at: int | None = None) -> Grant:
    return Grant({"id": key_id, "limit_micro_usd": limit}, (key_subject(key_id),), expires_at=expires_at)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(clock: Clock) -> AuthCache:
    return AuthCache(max_entries=3, max_age=4.0, clock=clock, wall=lambda: 5_000.0)


async def test_a_known_token_is_read_once_then_served_from_memory(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    for _ in range(5):
        grant = await cache.get("h1", table.loader("h1"))
        assert grant is not None and grant.value["id"] == "k1"
    assert table.loads == 1


async def test_an_unknown_token_is_never_cached_so_a_new_key_works_at_once(cache: AuthCache) -> None:
    table = Table()
    assert await cache.get("h1", table.loader("h1")) is None
    assert await cache.get("h1", table.loader("h1")) is None
    table.rows["h1"] = key("k1")  # the key is created after two refusals
    grant = await cache.get("h1", table.loader("h1"))
    assert grant is not None and grant.value["id"] == "k1"
    assert table.loads == 3 and len(cache) == 1


async def test_invalidating_a_subject_makes_the_next_lookup_read_the_change(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"], table.rows["h2"] = key("k1", limit=10), key("k2")
    await cache.get("h1", table.loader("h1"))
    await cache.get("h2", table.loader("h2"))
    table.rows["h1"] = key("k1", limit=0)  # PATCH
    cache.invalidate([key_subject("k1")])
    grant = await cache.get("h1", table.loader("h1"))
    assert grant is not None and grant.value["limit_micro_usd"] == 0
    del table.rows["h1"]  # DELETE
    cache.invalidate([key_subject("k1")])
    assert await cache.get("h1", table.loader("h1")) is None
    assert await cache.get("h2", table.loader("h2")) is not None
    assert table.loads == 4  # k2 stayed in memory


async def test_a_star_drops_everything(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    await cache.get("h1", table.loader("h1"))
    cache.invalidate(["*"])
    assert len(cache) == 0


async def test_least_recently_used_grants_go_first(cache: AuthCache) -> None:
    table = Table()
    for n in range(1, 5):
        table.rows[f"h{n}"] = key(f"k{n}")
    for digest in ("h1", "h2", "h3"):
        await cache.get(digest, table.loader(digest))
    await cache.get("h1", table.loader("h1"))  # h1 is now the most recent; h2 the least
    await cache.get("h4", table.loader("h4"))
    assert len(cache) == 3
    loads = table.loads
    await cache.get("h1", table.loader("h1"))
    assert table.loads == loads
    await cache.get("h2", table.loader("h2"))
    assert table.loads == loads + 1
    cache.invalidate([key_subject("k2")])  # the evicted grant's subject index was cleaned up too
    assert len(cache) == 2


async def test_an_expired_console_session_is_refused_like_the_database_refuses_it(clock: Clock) -> None:
    wall = [100.0]
    cache = AuthCache(max_age=60.0, clock=clock, wall=lambda: wall[0])
    table = Table()
    table.rows["s"] = key("k1", expires_at=101)
    assert await cache.get("s", table.loader("s")) is not None
    wall[0] = 100.9  # int(now) == 100 < 101: still valid, from memory
    assert await cache.get("s", table.loader("s")) is not None
    assert table.loads == 1
    wall[0] = 101.0  # expires_at > int(now) no longer holds: asked again, and the database says no
    del table.rows["s"]
    assert await cache.get("s", table.loader("s")) is None
    assert table.loads == 2 and len(cache) == 0


async def test_a_grant_past_max_age_is_read_again(cache: AuthCache, clock: Clock) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    await cache.get("h1", table.loader("h1"))
    del table.rows["h1"]  # revoked behind the API's back: no notice
    clock.now += 4.0
    assert await cache.get("h1", table.loader("h1")) is None
    assert table.loads == 2


async def test_past_half_its_age_a_grant_is_reloaded_in_the_background(cache: AuthCache, clock: Clock) -> None:
    table = Table()
    table.rows["h1"] = key("k1", limit=10)
    await cache.get("h1", table.loader("h1"))
    table.rows["h1"] = key("k1", limit=20)
    clock.now += 2.5
    served = await cache.get("h1", table.loader("h1"))
    assert served is not None and served.value["limit_micro_usd"] == 10  # served at once, reloaded meanwhile
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert table.loads == 2
    clock.now += 2.0  # 4.5 s after the first load, 2 s after the reload
    fresh = await cache.get("h1", table.loader("h1"))
    assert fresh is not None and fresh.value["limit_micro_usd"] == 20
    assert table.loads == 2


async def test_concurrent_first_uses_share_one_lookup(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    table.gate = asyncio.Event()
    waiting = [asyncio.create_task(cache.get("h1", table.loader("h1"))) for _ in range(10)]
    await table.started(1)  # the lookup every first use joined before it began
    table.gate.set()
    grants = await asyncio.gather(*waiting)
    assert all(g is not None for g in grants) and table.loads == 1


async def test_a_lookup_that_read_before_a_change_neither_is_joined_nor_stays(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    table.gate = asyncio.Event()
    before = asyncio.create_task(cache.get("h1", table.loader("h1")))
    await table.started(1)  # it has read the row and waits on the slow database
    del table.rows["h1"]
    cache.invalidate([key_subject("k1")])  # the revocation lands while that lookup is in flight
    after = asyncio.create_task(cache.get("h1", table.loader("h1")))
    await table.started(2)  # its own lookup, not the one in flight
    table.gate.set()
    assert (await before) is not None  # a request that started before the change
    assert (await after) is None       # the next one: its own lookup, not the stale one
    assert await cache.get("h1", table.loader("h1")) is None
    assert len(cache) == 0 and table.loads == 3


async def test_a_suspended_cache_stores_nothing_and_resumes_empty(cache: AuthCache) -> None:
    table = Table()
    table.rows["h1"] = key("k1")
    await cache.get("h1", table.loader("h1"))
    cache.suspend()
    assert not cache.caching and len(cache) == 0
    await cache.get("h1", table.loader("h1"))
    await cache.get("h1", table.loader("h1"))
    assert table.loads == 3 and len(cache) == 0
    cache.resume()
    await cache.get("h1", table.loader("h1"))
    await cache.get("h1", table.loader("h1"))
    assert table.loads == 4 and len(cache) == 1


async def test_a_failing_lookup_reaches_every_waiter_and_is_not_cached(cache: AuthCache) -> None:
    async def broken() -> Grant | None:
        raise ConnectionError("database down")
    with pytest.raises(ConnectionError):
        await cache.get("h1", broken)
    table = Table()
    table.rows["h1"] = key("k1")
    assert await cache.get("h1", table.loader("h1")) is not None
