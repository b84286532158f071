"""Per-minute rate limits (RPM, ITPM, OTPM) as token buckets: the interface in ``base``, one module
per implementation (``memory`` for one process, ``redis`` shared by replicas)."""

from __future__ import annotations

from darkbloom.coordinator.money.ratelimit.base import (
    Bucket,
    Charge,
    Decision,
    Dimension,
    RateLimiter,
    RateLimiterUnavailable,
)
from darkbloom.coordinator.money.ratelimit.memory import MemoryRateLimiter
from darkbloom.coordinator.money.ratelimit.redis import RedisRateLimiter

__all__ = [
    "Bucket", "Charge", "Decision", "Dimension", "MemoryRateLimiter", "RateLimiter",
    "RateLimiterUnavailable", "RedisRateLimiter", "create_rate_limiter",
]


def create_rate_limiter(redis_url: str | None) -> RateLimiter:
    """Redis-backed limits when a Redis URL is configured (several replicas), else in-process."""
    return RedisRateLimiter(redis_url) if redis_url else MemoryRateLimiter()
