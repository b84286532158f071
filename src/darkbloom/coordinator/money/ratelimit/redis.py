"""Token buckets shared by coordinator replicas through Redis.

The same bucket model and integer arithmetic as `base`, run inside one Lua script per call, so
the check and the debit of every bucket in a request are one atomic step on the server. The
script reads the server's clock (``TIME``), so replicas with drifting clocks still agree. Each
bucket is a hash ``{prefix}{scope}:{dimension}`` with fields ``level`` (units) and ``at``
(microseconds); it expires two minutes after it would be full again, and a missing bucket is full.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from darkbloom.coordinator.money.ratelimit.base import (
    Bucket,
    Charge,
    Decision,
    RateLimiterUnavailable,
    decide,
    merge,
)

log = logging.getLogger("darkbloom.ratelimit")

IDLE_TTL_MS = 120_000

# ARGV: idle ttl (ms), then limit, amount and units per token for each key in KEYS.
# A bucket of limit L refills L units per microsecond (L * 1000 per millisecond).
_PRELUDE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local idle_ms = tonumber(ARGV[1])

local function level_now(key, limit, units)
  local cap = limit * units
  local state = redis.call('HMGET', key, 'level', 'at')
  if not state[1] then return cap, false end
  local elapsed = math.max(0, now - tonumber(state[2]))
  return math.min(cap, tonumber(state[1]) + elapsed * limit), true
end

local function store(key, limit, units, level)
  local text = string.format('%.0f', level)
  redis.call('HSET', key, 'level', text, 'at', string.format('%.0f', now))
  local full_in_ms = math.ceil((limit * units - level) / (limit * 1000))
  redis.call('PEXPIRE', key, full_in_ms + idle_ms)
  return text
end
"""

_ACQUIRE_LUA = _PRELUDE + """
local levels = {}
local allowed = 1
for i = 1, #KEYS do
  local limit, units = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i + 1])
  levels[i] = level_now(KEYS[i], limit, units)
  if levels[i] < tonumber(ARGV[3 * i]) * units then allowed = 0 end
end
local out = {allowed}
for i = 1, #KEYS do
  local limit, units = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i + 1])
  if allowed == 1 then levels[i] = levels[i] - tonumber(ARGV[3 * i]) * units end
  out[i + 1] = store(KEYS[i], limit, units, levels[i])
end
return out
"""

_REFUND_LUA = _PRELUDE + """
for i = 1, #KEYS do
  local limit, units = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i + 1])
  local level, exists = level_now(KEYS[i], limit, units)
  if exists then store(KEYS[i], limit, units, math.min(limit * units, level + tonumber(ARGV[3 * i]) * units)) end
end
return 0
"""


class RedisRateLimiter:
    """Buckets in Redis, shared by every coordinator process that uses the same URL and prefix.

    `acquire` raises `RateLimiterUnavailable` when Redis cannot be reached (it never admits
    blindly); `refund` logs and swallows errors. `timeout` bounds connecting and each call.
    """

    def __init__(self, url: str, prefix: str = "darkbloom:rl:", *, timeout: float = 1.0) -> None:
        self._prefix = prefix
        self._redis = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout,
            retry=Retry(NoBackoff(), retries=1),  # one immediate retry covers a stale pooled connection
        )
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._refund = self._redis.register_script(_REFUND_LUA)

    def key(self, bucket: Bucket) -> str:
        return f"{self._prefix}{bucket.scope}:{bucket.dimension}"

    def _call(self, charges: list[Charge]) -> tuple[list[str], list[int]]:
        keys = [self.key(c.bucket) for c in charges]
        args = [IDLE_TTL_MS]
        for charge in charges:
            args += [charge.bucket.limit_per_minute, charge.amount, charge.bucket.units_per_token]
        return keys, args

    async def acquire(self, charges: Sequence[Charge]) -> Decision:
        merged = merge(charges)
        if not merged:
            return decide(merged, [], True)
        keys, args = self._call(merged)
        try:
            reply = await self._acquire(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise RateLimiterUnavailable(
                f"The rate-limit store (Redis) is unreachable ({exc}); "
                "check that Redis is running and that --redis-url points at it."
            ) from exc
        allowed, *levels = reply
        return decide(merged, [int(level) for level in levels], allowed == 1)

    async def refund(self, charges: Sequence[Charge]) -> None:
        merged = [c for c in merge(charges) if c.amount > 0]
        if not merged:
            return
        keys, args = self._call(merged)
        try:
            await self._refund(keys=keys, args=args)
        except Exception:  # a lost refund only makes a limit stricter for a minute
            log.warning("rate-limit refund failed for %s", keys, exc_info=True)

    async def close(self) -> None:
        await self._redis.aclose()

