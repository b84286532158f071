"""Provider slots: the one place a session's ``active`` count changes, and the order free slots are
taken in.

``Slots.claim`` takes one of a session's ``max_concurrency`` slots and returns the ``Slot``; its
``release`` (idempotent) gives it back and wakes whoever waits for a free slot (the request
queues subscribe with ``on_release``), so no caller has to remember to drain a queue.

``FreeOrder`` holds sessions with a free slot ready to be taken in the scheduler's order without a
scan of the fleet: those with the view's model loaded before those that would first have to load it
(``cold``), then grouped by (active, max_concurrency), i.e. by load ``(active + 1) /
max_concurrency``, and within a group bucketed by measured decode speed, fastest first (a heap of
speeds). The registry keeps one per view and moves a session between groups whenever its ``active``
count, its speed or its loaded models change.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Callable, Iterator

from darkbloom.coordinator.fleet.session import ProviderSession

Ties = list[list[ProviderSession]]  # the members of equally ranked buckets (one per group)


class Slot:
    __slots__ = ("session", "_book", "released", "ticket")

    def __init__(self, session: ProviderSession, book: "Slots", ticket: str | None = None) -> None:
        self.session = session
        self._book = book
        self.released = False
        self.ticket = ticket  # what the session's link knows the claim by (a claim on another replica)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._book._give_back(self)


class Slots:
    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def on_release(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def claim(self, session: ProviderSession) -> Slot:
        session.claim_slot()
        return Slot(session, self, session.link.claimed())

    def _give_back(self, slot: Slot) -> None:
        session = slot.session
        session.release_slot()
        session.link.released(slot.ticket)
        for listener in self._listeners:
            listener()


def mirror(session: ProviderSession, active: int) -> None:
    """A stand-in for another replica's session takes the count its holder announced (or, until the
    next announcement, a full one): with claim and release, the only writes to a session's count."""
    session.mirror_active(active)


def speed_of(session: ProviderSession) -> float:
    speed = session.decode_tps
    return speed if speed == speed else 0.0  # NaN would never find its bucket again


class _Bucket:
    """Sessions of one exact rank: add, remove and pick at random in O(1)."""

    __slots__ = ("members", "_index")

    def __init__(self) -> None:
        self.members: list[ProviderSession] = []
        self._index: dict[ProviderSession, int] = {}

    def add(self, session: ProviderSession) -> None:
        self._index[session] = len(self.members)
        self.members.append(session)

    def remove(self, session: ProviderSession) -> None:
        index = self._index.pop(session)
        last = self.members.pop()
        if last is not session:
            self.members[index] = last
            self._index[last] = index


class _Group:
    """Free sessions with one (cold, active, max_concurrency), bucketed by decode speed."""

    __slots__ = ("buckets", "_heap")

    def __init__(self) -> None:
        self.buckets: dict[float, _Bucket] = {}
        self._heap: list[float] = []  # negated speeds; entries of emptied buckets are dropped lazily

    def add(self, session: ProviderSession, speed: float) -> None:
        bucket = self.buckets.get(speed)
        if bucket is None:
            bucket = self.buckets[speed] = _Bucket()
            heapq.heappush(self._heap, -speed)
            if len(self._heap) > 2 * len(self.buckets) + 8:
                self._heap = [-known for known in self.buckets]
                heapq.heapify(self._heap)
        bucket.add(session)

    def remove(self, session: ProviderSession, speed: float) -> None:
        bucket = self.buckets[speed]
        bucket.remove(session)
        if not bucket.members:
            del self.buckets[speed]

    def fastest(self) -> float:
        heap = self._heap
        while -heap[0] not in self.buckets:
            heapq.heappop(heap)
        return -heap[0]


GroupKey = tuple[bool, int, int]  # (cold, active, max_concurrency)


class FreeOrder:
    """Sessions with a free slot; ``by_expected_wait`` and ``by_active`` yield them as ties, best first."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, _Group] = {}
        self._loads: list[tuple[bool, float, int, int]] = []  # (cold, load, active, max_concurrency), sorted
        self._at: dict[ProviderSession, tuple[GroupKey, float]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, session: object) -> bool:
        return session in self._at

    def __iter__(self) -> Iterator[ProviderSession]:
        return iter(self._at)

    def put(self, session: ProviderSession, cold: bool = False) -> None:
        """Add the session, or move it to the group and bucket of its current load and speed; ``cold``:
        it would first have to load the model."""
        where = ((cold, session.active, session.max_concurrency), speed_of(session))
        old = self._at.get(session)
        if old == where:
            return
        if old is not None:
            self._take(session, old)
        key, speed = where
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
            bisect.insort(self._loads, _load_of(key))
        group.add(session, speed)
        self._at[session] = where

    def discard(self, session: ProviderSession) -> None:
        old = self._at.pop(session, None)
        if old is not None:
            self._take(session, old)

    def _take(self, session: ProviderSession, where: tuple[GroupKey, float]) -> None:
        key, speed = where
        group = self._groups[key]
        group.remove(session, speed)
        if not group.buckets:
            del self._groups[key]
            self._loads.pop(bisect.bisect_left(self._loads, _load_of(key)))

    def by_expected_wait(self) -> Iterator[Ties]:
        """The scheduler's order: the model loaded first, then the lowest ``(active + 1) /
        max_concurrency``, then the fastest measured decode speed; each item is one rank (ties are
        broken by the caller)."""
        loads = list(self._loads)
        for _, same in itertools.groupby(loads, key=lambda entry: entry[:2]):
            yield from _by_speed([self._groups[(cold, active, slots)] for cold, _, active, slots in same])

    def by_active(self, idle_only: bool = False) -> Iterator[Ties]:
        """Retries and backups: the model loaded first, then the fewest active requests (only idle
        sessions if asked), then the fastest."""
        keys = sorted(key for key in self._groups if not idle_only or key[1] == 0)
        for _, same in itertools.groupby(keys, key=lambda key: key[:2]):
            yield from _by_speed([self._groups[key] for key in same])


def _load_of(key: GroupKey) -> tuple[bool, float, int, int]:
    cold, active, slots = key
    return cold, (active + 1) / slots, active, slots


def _by_speed(groups: list[_Group]) -> Iterator[Ties]:
    """Equally loaded groups merged by speed, fastest first; the full sort only if the first rank
    is not enough."""
    best = max(group.fastest() for group in groups)
    yield [group.buckets[best].members for group in groups if best in group.buckets]
    rest = sorted({speed for group in groups for speed in group.buckets if speed != best}, reverse=True)
    for speed in rest:
        yield [group.buckets[speed].members for group in groups if speed in group.buckets]
