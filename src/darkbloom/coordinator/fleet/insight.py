"""Machine insight: why a machine was passed over for public requests, how busy it was and how fast it
decoded, counted in memory and added to the ``machine_insight`` table in batches (docs/api.md
"Machine stats").

``passed_over`` is counted without a pass over the fleet per request. Each model's public view (the
sessions that pass the lasting gates, ``routing/scheduler.py``) carries a ``ViewTally``: a count of
the public requests selected through it, and for each member the count when it last became free or
busy. A request is counted once, at its first public selection. Then, for a machine that advertised
the model:

- ``busy``: requests selected while it had no free slot (settled when it frees a slot, leaves the
  view, or at a flush: O(1) per change of its slots, which happens anyway);
- the gate that turned it away, when the selection examined it (``challenge_stale``,
  ``context_length``, …: counted as it is decided);
- ``another_machine_chosen``: requests selected while it had a free slot that it neither served nor
  was turned away from (the selection stopped at a better-ranked machine before reaching it);
- a lasting gate (``trust_floor``, ``private_only``, ``runtime_unverified``, ``unverified_weights``,
  ``capability``): requests selected since the last flush while it was outside the view, the gate
  read at the flush (at most ``insight_interval`` seconds late) — one pass over the model's
  advertisers per flush that follows requests, not per request, and none while nothing was asked.

How busy and how fast (``MachineInsight``) is time, not samples: what a session held here has is
counted over each span in which it held still, when the span ends. An idle fleet costs nothing per
machine per flush (at 10,000 idle sessions, sampling each of them every flush was half of the
coordinator's idle CPU, bench/RESULTS.md).

Every replica counts the selections it makes and adds its counts to the database (one transaction per
flush, ``INSERT … ON CONFLICT DO UPDATE value = value + n``), so the figures are the fleet's sum with
or without Redis.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.fleet.flusher import Flusher
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.store import insight

log = logging.getLogger("darkbloom.insight")

PASSED_OVER_REASONS = ("busy", "trust_floor", "private_only", "challenge_stale", "runtime_unverified",
                       "capability", "unverified_weights", "context_length", "another_machine_chosen")
# the scheduler's gate names (routing/gates.py) as an owner is told them; model_not_served: not passed over
_BY_GATE = {"unverified_weights": "unverified_weights", "untrusted": "trust_floor", "private_only": "private_only",
            "trust_below_floor": "trust_floor", "runtime_not_verified": "runtime_unverified",
            "no_encrypted_chunks": "runtime_unverified", "challenge_stale": "challenge_stale",
            "capability_unsupported": "capability", "context_length": "context_length", "no_free_slot": "busy",
            "another_machine_chosen": "another_machine_chosen"}
TPS_BUCKET = 1.1  # decode speed samples in buckets 10 % wide
KEPT_HOURS = 24 * 30  # the machine stats' longest window: the counters of older hours are deleted


def reason_for(gate: str, session: ProviderSession) -> str | None:
    if gate == "untrusted" and session.draining and session.untrusted_reason is None:
        return "busy"  # draining: finishing what it has before it stops, not distrusted
    return _BY_GATE.get(gate)


class PassedOver:
    """Counts per (machine, reason) not yet written; ``take`` hands them to the flusher."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, session: ProviderSession, gate: str, n: int = 1) -> None:
        reason = reason_for(gate, session)
        if reason is not None and session.machine_id and n > 0:
            self.counts[(session.machine_id, reason)] += n

    def take(self) -> Counter[tuple[str, str]]:
        counts, self.counts = self.counts, Counter()
        return counts


class ViewTally:
    """The public requests selected through one model's public view, and what they passed over."""

    def __init__(self, book: PassedOver, why_not: Callable[[ProviderSession], str | None],
                 members: Iterable[tuple[ProviderSession, bool]]) -> None:
        self.book = book
        self.why_not = why_not  # the lasting gate a session outside the view fails (None: it passes)
        self.requests = 0
        self._attributed = 0  # requests already charged to the sessions outside the view
        self._since: dict[ProviderSession, tuple[int, bool]] = {s: (0, free) for s, free in members}
        self._chosen: Counter[ProviderSession] = Counter()
        self._turned: Counter[ProviderSession] = Counter()

    def request(self) -> None:
        self.requests += 1

    def chosen(self, session: ProviderSession) -> None:
        self._chosen[session] += 1

    def turned_away(self, session: ProviderSession, gate: str) -> None:
        self._turned[session] += 1
        self.book.add(session, gate)

    def placed(self, session: ProviderSession, free: bool) -> None:
        mark = self._since.get(session)
        if mark is not None and mark[1] == free:
            return
        self._settle(session)
        self._since[session] = (self.requests, free)

    def left(self, session: ProviderSession) -> None:
        self._settle(session)
        self._since.pop(session, None)

    @property
    def unsettled(self) -> bool:
        """Whether requests were selected since the last flush (without, a flush has nothing to count)."""
        return self.requests != self._attributed

    def flush(self, advertisers: Iterable[ProviderSession]) -> None:
        """Settle every member, and charge the requests since the last flush to the advertisers outside
        the view, by the lasting gate each fails now."""
        for session in list(self._since):
            self._settle(session)
        n, self._attributed = self.requests - self._attributed, self.requests
        if not n:
            return
        for session in advertisers:
            if session not in self._since:
                gate = self.why_not(session)
                if gate is not None:
                    self.book.add(session, gate, n)

    def _settle(self, session: ProviderSession) -> None:
        mark = self._since.get(session)
        if mark is None:
            return
        start, free = mark
        n = self.requests - start
        chosen, turned = self._chosen.pop(session, 0), self._turned.pop(session, 0)
        if free:
            self.book.add(session, "another_machine_chosen", n - chosen - turned)
        else:
            self.book.add(session, "no_free_slot", n)
        self._since[session] = (self.requests, free)


def hour_of(when: float) -> int:
    return int(when // 3600 * 3600)


def tps_bucket(tps: float) -> int:
    return max(0, math.floor(math.log(max(tps, 1.0), TPS_BUCKET)))


def tps_of_bucket(bucket: int) -> float:
    """A bucket's middle (geometric), as the decode speed it stands for."""
    return round(math.pow(TPS_BUCKET, bucket + 0.5), 1)


class _Fleet(Protocol):
    """What the insight reads of the registry (fleet/registry.py, which builds on this module)."""

    passed_over: PassedOver
    listeners: list[Callable[[ProviderSession], None]]

    def settle_tallies(self) -> None: ...

    def for_machine(self, machine_id: str) -> set[ProviderSession]: ...


@dataclass(slots=True)
class _Meter:
    """A session's state since ``since`` (wall-clock seconds), up to which its time is counted; two
    meters are equal when the state is, whatever their ``since``."""

    machine_id: str
    since: float = field(compare=False)
    busy: int        # active slots
    slots: int       # max_concurrency
    tps: int | None  # the decode speed's bucket; None before it is measured


def _meter_of(session: ProviderSession, now: float) -> _Meter | None:
    if not session.online or not session.machine_id:
        return None
    tps = session.decode_tps
    return _Meter(session.machine_id, now, session.active, session.max_concurrency,
                  tps_bucket(tps) if tps == tps and tps > 0 else None)


def _hours(start: float, end: float) -> Iterator[tuple[int, float]]:
    """(hour, seconds) of the span [start, end) in each UTC hour it covers."""
    while start < end:
        hour = hour_of(start)
        stop = min(end, hour + 3600)
        yield hour, stop - start
        start = stop


class MachineInsight:
    """Time, not samples: what a session held here had (busy slots, slots, decode speed) is counted in
    milliseconds over the spans it held still, each span added when it ends — when the session
    changes (a slot claimed or freed, a new speed, offline) — so a request costs a few additions and
    an idle session nothing until it is counted. Every ``interval`` seconds the busy sessions'
    time so far and the idle sessions not counted for ``IDLE_COUNT`` seconds are added, with the
    views' tallies, to ``machine_insight`` in one transaction: the work follows the traffic and a
    fraction of the fleet per interval, never a pass over it. A batch that fails is kept and added
    to the next. The first write of each hour also deletes the counters older than ``KEPT_HOURS``
    (every replica does; the later ones find nothing), so the table follows the fleet, not its age."""

    IDLE_COUNT = 300.0  # seconds an idle session's time waits at most before it is added

    def __init__(self, registry: _Fleet, engine: AsyncEngine, interval: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._engine = engine
        self._clock = clock
        self._pending: defaultdict[tuple[str, int, str], float] = defaultdict(float)
        self._meters: OrderedDict[ProviderSession, _Meter] = OrderedDict()  # least recently counted first
        self._busy: set[ProviderSession] = set()
        self._pruned_hour: int | None = None  # the hour whose older counters were last deleted
        self._flusher = Flusher("machine-insight", self.flush, interval, log=log, what=lambda: "machine insight",
                                last_write=lambda: self.flush(everything=True))
        registry.listeners.append(self.changed)

    def start(self) -> None:
        self._flusher.start()

    async def close(self) -> None:
        await self._flusher.close()

    def changed(self, session: ProviderSession) -> None:
        """A session held here changed (the registry's listener): end its span if what is counted changed."""
        now = self._clock()
        meter = self._meters.get(session)
        fresh = _meter_of(session, now)
        if meter is not None and meter == fresh:
            return
        self._count(session, now, fresh)

    def _count(self, session: ProviderSession, now: float, fresh: _Meter | None) -> None:
        """Add the session's span up to ``now`` and start the next with ``fresh`` (None: not counted)."""
        meter = self._meters.pop(session, None)
        if meter is not None:
            for hour, seconds in _hours(meter.since, now):
                pending, key = self._pending, (meter.machine_id, hour)
                pending[(*key, "slot_ms")] += 1000 * seconds * meter.slots
                if meter.busy:
                    pending[(*key, "busy_slot_ms")] += 1000 * seconds * meter.busy
                if meter.tps is not None:
                    pending[(*key, f"tps_ms:{meter.tps}")] += 1000 * seconds
        if fresh is None:
            self._busy.discard(session)
            return
        self._meters[session] = fresh
        if fresh.busy:
            self._busy.add(session)
        else:
            self._busy.discard(session)

    def collect(self, now: float, machine_id: str | None = None, everything: bool = False) -> None:
        """Bring the pending counts up to ``now``: the tallies, the busy sessions' time, the idle sessions'
        not counted for ``IDLE_COUNT`` (or the sessions of ``machine_id``, or every session)."""
        hour = hour_of(now)
        registry = self._registry
        registry.settle_tallies()
        for (machine, reason), n in registry.passed_over.take().items():
            self._pending[(machine, hour, f"passed_over:{reason}")] += n
        due = list(self._meters) if everything else list(self._busy)
        if machine_id is not None:
            due += [s for s in registry.for_machine(machine_id) if s in self._meters]
        for session in due:
            self._count(session, now, _meter_of(session, now))
        while self._meters:
            session, meter = next(iter(self._meters.items()))
            if meter.since >= now - self.IDLE_COUNT:
                break  # (a session counted now goes back with ``since == now``: the loop always ends)
            self._count(session, now, _meter_of(session, now))

    async def flush(self, machine_id: str | None = None, everything: bool = False) -> None:
        """Collect (see ``collect``) and add what is pending in one transaction, with the deletion of
        hours past ``KEPT_HOURS`` in the first of each hour."""
        now = self._clock()
        self.collect(now, machine_id, everything)
        hour = hour_of(now)
        if not self._pending and hour == self._pruned_hour:
            return
        batch, self._pending = self._pending, defaultdict(float)
        try:
            async with self._engine.begin() as conn:
                await insight.add(conn, {key: round(value) for key, value in batch.items()})
                if hour != self._pruned_hour:
                    await insight.prune(conn, hour - (KEPT_HOURS - 1) * 3600)
        except BaseException:
            for key, value in batch.items():
                self._pending[key] += value
            raise
        self._pruned_hour = hour
