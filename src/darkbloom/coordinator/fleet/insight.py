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
  advertisers per flush, not per request.

Every replica counts the selections it makes and adds its counts to the database (one transaction per
flush, ``INSERT … ON CONFLICT DO UPDATE value = value + n``), so the figures are the fleet's sum with
or without Redis.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import Callable, Iterable, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

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
    return round(TPS_BUCKET ** (bucket + 0.5), 1)


class _Fleet(Protocol):
    """What the flusher reads of the registry (fleet/registry.py, which builds on this module)."""

    passed_over: PassedOver

    def settle_tallies(self) -> None: ...

    def held_here(self) -> list[ProviderSession]: ...


class MachineInsight:
    """Every ``interval`` seconds: settle the views' tallies, sample the sessions held here (active
    slots, capacity, decode speed), and add it all to ``machine_insight`` in one transaction. A batch
    that fails is kept and added to the next."""

    def __init__(self, registry: _Fleet, engine: AsyncEngine, interval: float) -> None:
        self._registry = registry
        self._engine = engine
        self.interval = interval
        self._pending: Counter[tuple[str, int, str]] = Counter()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="machine-insight")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.flush(sample=False)
        except Exception:  # noqa: BLE001 - the process is stopping; say what is lost
            log.exception("could not record the machine insight of the last %g s", self.interval)

    def collect(self, now: float, sample: bool = True) -> None:
        hour = hour_of(now)
        registry = self._registry
        registry.settle_tallies()
        for (machine_id, reason), n in registry.passed_over.take().items():
            self._pending[(machine_id, hour, f"passed_over:{reason}")] += n
        if not sample:
            return
        for session in registry.held_here():
            if not session.machine_id or not session.online:
                continue
            self._pending[(session.machine_id, hour, "slots_busy")] += session.active
            self._pending[(session.machine_id, hour, "slots_total")] += session.max_concurrency
            if session.decode_tps == session.decode_tps and session.decode_tps > 0:
                self._pending[(session.machine_id, hour, f"tps:{tps_bucket(session.decode_tps)}")] += 1

    async def flush(self, sample: bool = True, now: float | None = None) -> None:
        self.collect(time.time() if now is None else now, sample)
        if not self._pending:
            return
        batch, self._pending = self._pending, Counter()
        try:
            async with self._engine.begin() as conn:
                await insight.add(conn, batch)
        except BaseException:
            self._pending.update(batch)
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - kept; the next round adds it
                log.warning("could not record machine insight (%r); retrying in %g s", exc, self.interval)
