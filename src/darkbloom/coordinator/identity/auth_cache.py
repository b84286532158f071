"""Authentication from memory: token hash → grant, filled on first use.

What is cached: for each bearer token that authenticated (API key ``dk-``, console session ``dks-``,
device token ``dkp-``), its SHA-256 hash (as the database stores it) → a ``Grant``: what the token
resolves to (the caller the HTTP edge builds, with its ``ApiKey`` as billing and rate limits read it),
the subjects a change is announced under (``key:<id>``, ``session:<hash>``, ``machine:<id>``) and,
for a console session, its expiry. An unknown token is never cached: a miss always asks the
database, so a key created a moment ago is never refused.

Bounds: at most ``max_entries`` grants (the least recently used goes first). A grant older than
``max_age`` seconds is loaded again before it is used, and one past half of that is reloaded in the
background while it keeps serving, so a token in steady use never waits for the database. An
expired console session is refused exactly as the database query refuses it (``expires_at > now``).

Consistency: ``invalidate(subjects)`` drops every grant announced under one of them, forgets the
loads in flight (the next request starts its own instead of joining one that may have read the row
before the change) and bumps an epoch, so that no load that started before the change can put its
answer back. While the channel that carries other processes' changes is down the cache is
``suspend``-ed: it stores nothing and every request asks the database, as before the cache existed;
``resume`` starts it empty, because notices may have been missed meanwhile. How changes travel
between processes: ``auth_invalidation``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from prometheus_client import Counter

from darkbloom.coordinator.identity.caller import Caller

log = logging.getLogger("darkbloom.auth")

MAX_ENTRIES = 10_000
MAX_AGE = 5.0  # seconds: the backstop should a change's notice never arrive

LOOKUPS = Counter("darkbloom_auth_cache_lookups_total",
                  "Bearer-token lookups: served from memory (hit) or read from the database (miss)", ["result"])
_HIT = LOOKUPS.labels("hit")
_MISS = LOOKUPS.labels("miss")


def key_subject(key_id: str) -> str:
    return f"key:{key_id}"


def session_subject(session_hash: str) -> str:
    return f"session:{session_hash}"


def machine_subject(machine_id: str) -> str:
    return f"machine:{machine_id}"


@dataclass(frozen=True, slots=True)
class Grant:
    value: Caller                  # what the token resolves to (frozen: grants are shared)
    subjects: tuple[str, ...]      # a change announced under any of these drops the grant
    expires_at: int | None = None  # Unix seconds (console sessions); None: valid until a change


@dataclass(slots=True)
class _Entry:
    grant: Grant
    loaded_at: float
    refreshing: bool = False


Loader = Callable[[], Awaitable[Grant | None]]


class AuthCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_age: float = MAX_AGE, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self._clock = clock
        self._wall = wall
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_subject: dict[str, set[str]] = {}
        self._inflight: dict[str, asyncio.Task[Grant | None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._epoch = 0
        self._caching = True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def caching(self) -> bool:
        return self._caching

    async def get(self, digest: str, load: Loader) -> Grant | None:
        """The grant of the token hashed to ``digest``; ``load`` reads it from the database on a miss."""
        entry = self._entries.get(digest)
        if entry is not None:
            age = self._clock() - entry.loaded_at
            expires_at = entry.grant.expires_at
            if age < self.max_age and (expires_at is None or expires_at > int(self._wall())):
                self._entries.move_to_end(digest)
                if age >= self.max_age / 2 and not entry.refreshing:
                    entry.refreshing = True
                    self._refresh_later(digest, load)
                _HIT.inc()
                return entry.grant
            self._drop(digest)
        _MISS.inc()
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fill(digest, load))
            self._inflight[digest] = task
            task.add_done_callback(lambda done: self._load_done(digest, done))
        return await asyncio.shield(task)

    def invalidate(self, subjects: Iterable[str]) -> None:
        """Drop every grant announced under one of ``subjects`` (``*``: all of them)."""
        self._epoch += 1
        self._inflight.clear()
        for subject in subjects:
            if subject == "*":
                self.clear()
                return
            for digest in tuple(self._by_subject.get(subject, ())):
                self._drop(digest)

    def clear(self) -> None:
        self._epoch += 1
        self._inflight.clear()
        self._entries.clear()
        self._by_subject.clear()

    def suspend(self) -> None:
        """Store nothing until ``resume``: changes made elsewhere could not reach this process."""
        self._caching = False
        self.clear()

    def resume(self) -> None:
        self.clear()
        self._caching = True

    async def close(self) -> None:
        for task in tuple(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(set(self._background))

    async def _fill(self, digest: str, load: Loader) -> Grant | None:
        epoch = self._epoch
        grant = await load()
        if grant is not None and self._caching and epoch == self._epoch:
            self._put(digest, grant)
        return grant

    def _load_done(self, digest: str, task: asyncio.Task[Grant | None]) -> None:
        if self._inflight.get(digest) is task:
            del self._inflight[digest]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have gone away

    def _refresh_later(self, digest: str, load: Loader) -> None:
        task = asyncio.get_running_loop().create_task(self._refresh(digest, load))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh(self, digest: str, load: Loader) -> None:
        epoch = self._epoch
        try:
            grant = await load()
        except Exception:  # noqa: BLE001 - the next lookup past max_age loads in the request and reports it
            log.debug("background reload of a token grant failed", exc_info=True)
            entry = self._entries.get(digest)
            if entry is not None:
                entry.refreshing = False
            return
        if epoch != self._epoch:
            return  # a change arrived meanwhile: what was read may predate it
        if grant is None:
            self._drop(digest)  # revoked behind the API's back (an operator's UPDATE)
        elif self._caching:
            self._put(digest, grant)

    def _put(self, digest: str, grant: Grant) -> None:
        self._drop(digest)
        self._entries[digest] = _Entry(grant, self._clock())
        for subject in grant.subjects:
            self._by_subject.setdefault(subject, set()).add(digest)
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self._drop(oldest)

    def _drop(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return
        for subject in entry.grant.subjects:
            digests = self._by_subject.get(subject)
            if digests is not None:
                digests.discard(digest)
                if not digests:
                    del self._by_subject[subject]
