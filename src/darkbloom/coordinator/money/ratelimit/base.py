"""Per-minute rate limits (RPM, ITPM, OTPM) as token buckets.

Each limit is one bucket, named by a scope (``key:key_…`` or ``acct:acct_…``) and a dimension
(``requests``, ``input_tokens``, ``output_tokens``). A bucket holds at most ``limit_per_minute``
tokens, starts full and refills continuously at ``limit_per_minute / 60`` tokens per second, so a
caller may burst up to the whole minute's allowance and then proceeds at the steady rate. A bucket
with ``minutes`` > 1 refills the same capacity over that many minutes instead (the ``attempts`` of
sign-up and log-in: ten per fifteen minutes, say).

A request charges several buckets at once (its key's and its account's, for each dimension).
``acquire`` is all-or-nothing: the request is admitted only if every bucket holds its amount, and
only then are all of them debited. ``refund`` puts back what a request did not use (the unused
part of an output-token charge), never beyond capacity. A bucket's state is its level and the time
it was last written; the limit itself comes with every call, so an edited limit takes effect at
once (the level is kept, clamped to the new capacity). A bucket with no state is full.

Levels are integers in units of 1/(60,000,000 × minutes) of a token: a bucket of limit L then
refills exactly L units per microsecond, and Python (``memory``) and the Redis script (``redis``) do
the same exact integer arithmetic. This module holds the interface, the values every limiter speaks in and that
shared arithmetic; ``MemoryRateLimiter`` serves one process, ``RedisRateLimiter`` shares the buckets
between coordinator replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

Dimension = Literal["requests", "input_tokens", "output_tokens", "attempts"]

DIMENSIONS: tuple[Dimension, ...] = get_args(Dimension)
MICROS = 1_000_000
UNITS_PER_TOKEN = 60 * MICROS  # a one-minute bucket of limit L refills L units per microsecond
IMPOSSIBLE_RETRY_AFTER = 60
_HEADER_SUFFIX: dict[str, str] = {
    "requests": "requests", "input_tokens": "input-tokens", "output_tokens": "output-tokens",
    "attempts": "attempts",
}


class RateLimiterUnavailable(Exception):
    """The shared rate-limit store cannot be reached, so no request can be admitted."""


@dataclass(frozen=True)
class Bucket:
    scope: str
    dimension: Dimension
    limit_per_minute: int
    minutes: int = 1  # the time the whole capacity takes to refill

    def __post_init__(self) -> None:
        if self.dimension not in DIMENSIONS:
            raise ValueError(f"unknown rate-limit dimension {self.dimension!r}")
        if self.limit_per_minute < 1:
            raise ValueError(f"limit_per_minute must be at least 1, got {self.limit_per_minute}")
        if self.minutes < 1:
            raise ValueError(f"minutes must be at least 1, got {self.minutes}")

    @property
    def units_per_token(self) -> int:
        return UNITS_PER_TOKEN * self.minutes


@dataclass(frozen=True)
class Charge:
    bucket: Bucket
    amount: int

    def __post_init__(self) -> None:
        if self.amount < 0:
            raise ValueError(f"a charge amount cannot be negative, got {self.amount}")


@dataclass(frozen=True)
class Decision:
    allowed: bool
    failed: Bucket | None
    retry_after_seconds: int
    headers: dict[str, str]


class RateLimiter(Protocol):
    async def acquire(self, charges: Sequence[Charge]) -> Decision: ...
    async def refund(self, charges: Sequence[Charge]) -> None: ...
    async def close(self) -> None: ...


# --- bucket arithmetic shared by both limiters (levels in units) ---

def capacity(bucket: Bucket) -> int:
    return bucket.limit_per_minute * bucket.units_per_token


def refilled(level: int, elapsed_us: int, bucket: Bucket) -> int:
    return min(capacity(bucket), level + max(0, elapsed_us) * bucket.limit_per_minute)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _seconds_to_hold(level: int, units: int, limit: int) -> int:
    """Whole seconds until a bucket at `level` holds `units` (0 if it already does)."""
    return max(0, _ceil_div(units - level, limit * MICROS))


def merge(charges: Sequence[Charge]) -> list[Charge]:
    """One charge per (scope, dimension): amounts add up, the smallest limit given wins."""
    merged: dict[tuple[str, str], Charge] = {}
    for charge in charges:
        key = (charge.bucket.scope, charge.bucket.dimension)
        prev = merged.get(key)
        if prev is None:
            merged[key] = charge
        else:
            bucket = min(prev.bucket, charge.bucket, key=lambda b: b.limit_per_minute)
            merged[key] = Charge(bucket, prev.amount + charge.amount)
    return list(merged.values())


def decide(charges: Sequence[Charge], levels: Sequence[int], allowed: bool) -> Decision:
    """The decision for merged `charges`, given each bucket's level after the call."""
    headers = _headers(charges, levels)
    if allowed:
        return Decision(True, None, 0, headers)
    for charge in charges:
        if charge.amount > charge.bucket.limit_per_minute:  # can never fit: say so, don't loop
            return Decision(False, charge.bucket, IMPOSSIBLE_RETRY_AFTER, headers)
    for charge, level in zip(charges, levels):
        bucket = charge.bucket
        wait = _seconds_to_hold(level, charge.amount * bucket.units_per_token, bucket.limit_per_minute)
        if wait > 0:
            return Decision(False, bucket, wait, headers)
    return Decision(False, charges[0].bucket, 1, headers)  # refilled since the check: retry now


def _headers(charges: Sequence[Charge], levels: Sequence[int]) -> dict[str, str]:
    tightest: dict[str, tuple[int, Bucket, int]] = {}
    for charge, level in zip(charges, levels):
        remaining = level // charge.bucket.units_per_token
        current = tightest.get(charge.bucket.dimension)
        if current is None or remaining < current[0]:
            tightest[charge.bucket.dimension] = (remaining, charge.bucket, level)
    headers: dict[str, str] = {}
    for dimension in DIMENSIONS:
        if dimension not in tightest:
            continue
        remaining, bucket, level = tightest[dimension]
        limit = bucket.limit_per_minute
        suffix = _HEADER_SUFFIX[dimension]
        headers[f"x-ratelimit-limit-{suffix}"] = str(limit)
        headers[f"x-ratelimit-remaining-{suffix}"] = str(remaining)
        headers[f"x-ratelimit-reset-{suffix}"] = f"{_seconds_to_hold(level, capacity(bucket), limit)}s"
    return headers
