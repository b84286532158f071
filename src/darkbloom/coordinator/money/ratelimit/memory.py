"""Token buckets in one coordinator process."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from darkbloom.coordinator.money.ratelimit.base import (
    MICROS,
    Bucket,
    Charge,
    Decision,
    capacity,
    decide,
    merge,
    refilled,
)

_SWEEP_EVERY_US = 60 * MICROS


class MemoryRateLimiter:
    """Buckets in a dict, for a single coordinator process.

    `clock` returns seconds (default `time.monotonic`). Each call reads and writes the dict without
    awaiting in between, so the event loop cannot interleave two calls and no lock is needed.
    Buckets that have refilled to full are dropped about once a minute (no state means full).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[tuple[str, str], tuple[int, int, Bucket]] = {}  # level, at (µs), last bucket
        self._next_sweep_us: int | None = None

    def _now_us(self) -> int:
        return round(self._clock() * MICROS)

    def _level(self, bucket: Bucket, now_us: int) -> int:
        state = self._state.get((bucket.scope, bucket.dimension))
        if state is None:
            return capacity(bucket)
        level, at_us, _ = state
        return refilled(level, now_us - at_us, bucket)  # clamps to a lowered limit

    def _store(self, bucket: Bucket, level: int, now_us: int) -> None:
        self._state[(bucket.scope, bucket.dimension)] = (level, now_us, bucket)

    async def acquire(self, charges: Sequence[Charge]) -> Decision:
        merged = merge(charges)
        now_us = self._now_us()
        self._sweep(now_us)
        levels = [self._level(c.bucket, now_us) for c in merged]
        allowed = all(c.amount * c.bucket.units_per_token <= level for c, level in zip(merged, levels))
        if allowed:
            levels = [level - c.amount * c.bucket.units_per_token for c, level in zip(merged, levels)]
        for charge, level in zip(merged, levels):
            self._store(charge.bucket, level, now_us)
        return decide(merged, levels, allowed)

    async def refund(self, charges: Sequence[Charge]) -> None:
        now_us = self._now_us()
        for charge in merge(charges):
            bucket = charge.bucket
            if (bucket.scope, bucket.dimension) not in self._state:
                continue  # already full
            level = self._level(bucket, now_us) + charge.amount * bucket.units_per_token
            self._store(bucket, min(level, capacity(bucket)), now_us)

    async def close(self) -> None:
        self._state.clear()

    def _sweep(self, now_us: int) -> None:
        if self._next_sweep_us is not None and now_us < self._next_sweep_us:
            return
        self._next_sweep_us = now_us + _SWEEP_EVERY_US
        full = [key for key, (level, at_us, bucket) in self._state.items()
                if refilled(level, now_us - at_us, bucket) >= capacity(bucket)]
        for key in full:
            del self._state[key]
