"""Token-bucket rate limits: the same behaviours on the in-process and the Redis limiter.

The memory limiter runs on an injected clock. On Redis, the script reads the server's clock, so
`advance` moves every bucket's last-write time back instead; the real clock still runs, adding a
tiny refill (well under a token) that the assertions below leave room for.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import pytest
import redis.asyncio as redis

from darkbloom.coordinator.money.ratelimit import (
    Bucket,
    Charge,
    Decision,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    create_rate_limiter,
)

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Harness(Protocol):
    limiter: RateLimiter

    async def advance(self, seconds: float) -> None: ...


class MemoryHarness:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.limiter: RateLimiter = MemoryRateLimiter(clock=self.clock)

    async def advance(self, seconds: float) -> None:
        self.clock.now += seconds


class RedisHarness:
    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.limiter: RateLimiter = RedisRateLimiter(REDIS_URL, prefix=prefix)

    async def advance(self, seconds: float) -> None:
        async for key in self.client.scan_iter(match=self.prefix + "*"):
            await self.client.hincrby(key, "at", -round(seconds * 1_000_000))


@asynccontextmanager
async def redis_prefix() -> AsyncIterator[tuple[redis.Redis, str]]:
    """A unique key prefix on the machine's Redis; every key under it is deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"darkbloom:rl:test:{secrets.token_hex(6)}:"
    try:
        yield client, prefix
    finally:
        async for key in client.scan_iter(match=prefix + "*"):
            await client.delete(key)
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def rl(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        yield MemoryHarness()
        return
    async with redis_prefix() as (client, prefix):
        harness = RedisHarness(client, prefix)
        try:
            yield harness
        finally:
            await harness.limiter.close()


def rpm(limit: int, scope: str = "key:key_a") -> Bucket:
    return Bucket(scope, "requests", limit)


def itpm(limit: int, scope: str = "key:key_a") -> Bucket:
    return Bucket(scope, "input_tokens", limit)


def otpm(limit: int, scope: str = "key:key_a") -> Bucket:
    return Bucket(scope, "output_tokens", limit)


async def take(rl: Harness, *charges: tuple[Bucket, int]) -> Decision:
    return await rl.limiter.acquire([Charge(b, n) for b, n in charges])


async def test_admits_until_empty_then_refuses_with_the_refill_wait(rl: Harness) -> None:
    bucket = rpm(5)
    for remaining in (4, 3, 2, 1, 0):
        decision = await take(rl, (bucket, 1))
        assert decision.allowed and decision.failed is None and decision.retry_after_seconds == 0
        assert decision.headers["x-ratelimit-remaining-requests"] == str(remaining)

    refused = await take(rl, (bucket, 1))
    assert not refused.allowed
    assert refused.failed == bucket
    assert refused.retry_after_seconds == 12  # one request at 5/min = 12 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


async def test_retry_after_follows_the_refill_rate(rl: Harness) -> None:
    bucket = otpm(60)  # refills 1 token per second
    assert (await take(rl, (bucket, 60))).allowed
    await rl.advance(0.25)  # holds 0.25 tokens

    assert (await take(rl, (bucket, 10))).retry_after_seconds == 10  # needs 9.75 more
    assert (await take(rl, (bucket, 3))).retry_after_seconds == 3  # needs 2.75 more
    assert (await take(rl, (rpm(7), 8))).retry_after_seconds == 60  # more than 7 can never fit

    await rl.advance(2)
    assert not (await take(rl, (bucket, 3))).allowed  # 2.25 tokens
    await rl.advance(1)
    assert (await take(rl, (bucket, 3))).allowed  # 3.25 tokens


async def test_retry_after_rounds_up_to_whole_seconds(rl: Harness) -> None:
    bucket = rpm(7)  # a request every 60/7 = 8.57 s
    for _ in range(7):
        assert (await take(rl, (bucket, 1))).allowed
    refused = await take(rl, (bucket, 1))
    assert refused.retry_after_seconds == 9

    await rl.advance(8.0)  # on Redis real time passes too (its clock): a margin for a busy machine
    assert not (await take(rl, (bucket, 1))).allowed
    await rl.advance(0.6)
    assert (await take(rl, (bucket, 1))).allowed


async def test_refills_over_time_up_to_capacity(rl: Harness) -> None:
    bucket = rpm(6)  # one request per 10 s
    for _ in range(6):
        assert (await take(rl, (bucket, 1))).allowed
    assert not (await take(rl, (bucket, 1))).allowed

    await rl.advance(10)
    assert (await take(rl, (bucket, 1))).allowed
    assert not (await take(rl, (bucket, 1))).allowed

    await rl.advance(600)  # ten minutes refill only to the capacity
    admitted = [(await take(rl, (bucket, 1))).allowed for _ in range(8)]
    assert admitted == [True] * 6 + [False] * 2


async def test_a_bucket_of_several_minutes_refills_its_capacity_over_them(rl: Harness) -> None:
    bucket = Bucket("login-email:ada", "attempts", 10, minutes=15)  # one attempt back every 90 s
    for _ in range(10):
        assert (await take(rl, (bucket, 1))).allowed
    refused = await take(rl, (bucket, 1))
    assert not refused.allowed and refused.failed == bucket and refused.retry_after_seconds == 90

    await rl.advance(89)
    assert not (await take(rl, (bucket, 1))).allowed
    await rl.advance(1.5)
    assert (await take(rl, (bucket, 1))).allowed
    assert not (await take(rl, (bucket, 1))).allowed

    await rl.limiter.refund([Charge(bucket, 1)])  # a refund gives back one whole attempt
    assert (await take(rl, (bucket, 1))).allowed
    await rl.advance(15 * 60 * 2)
    admitted = [(await take(rl, (bucket, 1))).allowed for _ in range(11)]
    assert admitted == [True] * 10 + [False]


def test_a_bucket_refills_over_at_least_a_minute() -> None:
    with pytest.raises(ValueError):
        Bucket("login-email:ada", "attempts", 10, minutes=0)


async def test_a_refused_multi_bucket_acquire_debits_nothing(rl: Harness) -> None:
    key_rpm, key_itpm = rpm(10), itpm(50)
    acct_itpm = itpm(100, scope="acct:acct_a")

    refused = await take(rl, (key_rpm, 1), (acct_itpm, 60), (key_itpm, 60))
    assert not refused.allowed and refused.failed == key_itpm
    assert refused.retry_after_seconds == 60  # 60 > the key's 50/min: never fits

    assert (await take(rl, (key_rpm, 1), (acct_itpm, 40), (key_itpm, 40))).allowed
    refused = await take(rl, (key_rpm, 1), (acct_itpm, 20), (key_itpm, 20))
    assert not refused.allowed and refused.failed == key_itpm
    assert refused.retry_after_seconds == 12  # 10 more tokens at 50/min

    # Nothing of the refused calls was taken: 9 requests and 60 account tokens are left.
    ok = await take(rl, (key_rpm, 9), (acct_itpm, 60))
    assert ok.allowed
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok.headers["x-ratelimit-remaining-input-tokens"] == "0"


async def test_the_first_refusing_bucket_is_reported(rl: Harness) -> None:
    key, acct = rpm(2), rpm(2, scope="acct:acct_a")
    assert (await take(rl, (key, 2), (acct, 2))).allowed
    assert (await take(rl, (acct, 1), (key, 1))).failed == acct
    assert (await take(rl, (key, 1), (acct, 1))).failed == key


async def test_an_amount_over_capacity_is_refused_even_when_full(rl: Harness) -> None:
    small, big = itpm(100), rpm(5)
    refused = await take(rl, (big, 1), (small, 101))
    assert not refused.allowed
    assert refused.failed == small
    assert refused.retry_after_seconds == 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "5"  # nothing debited
    assert refused.headers["x-ratelimit-remaining-input-tokens"] == "100"
    assert (await take(rl, (small, 100))).allowed  # exactly the capacity fits


async def test_refund_adds_back_and_caps_at_capacity(rl: Harness) -> None:
    bucket = otpm(100)
    await rl.limiter.refund([Charge(bucket, 500)])  # unknown bucket: full already, nothing to do
    assert (await take(rl, (bucket, 80))).allowed
    await rl.limiter.refund([Charge(bucket, 30)])
    assert (await take(rl, (bucket, 0))).headers["x-ratelimit-remaining-output-tokens"] == "50"

    await rl.limiter.refund([Charge(bucket, 80)])
    full = await take(rl, (bucket, 0))
    assert full.headers["x-ratelimit-remaining-output-tokens"] == "100"
    assert not (await take(rl, (bucket, 101))).allowed


async def test_a_changed_limit_keeps_the_level_clamped_to_the_new_capacity(rl: Harness) -> None:
    assert (await take(rl, (rpm(100), 10))).allowed  # 90 left

    lowered = await take(rl, (rpm(50), 0))
    assert lowered.headers["x-ratelimit-limit-requests"] == "50"
    assert lowered.headers["x-ratelimit-remaining-requests"] == "50"

    raised = await take(rl, (rpm(100), 0))  # the clamp stuck: still 50, refilling at 100/min
    assert raised.headers["x-ratelimit-remaining-requests"] == "50"
    assert raised.headers["x-ratelimit-reset-requests"] == "30s"
    await rl.advance(30)
    assert (await take(rl, (rpm(100), 100))).allowed


async def test_headers_report_the_tightest_bucket_of_each_dimension(rl: Harness) -> None:
    decision = await take(
        rl,
        (rpm(60), 1), (rpm(600, scope="acct:acct_a"), 1),
        (itpm(1000), 100), (itpm(200, scope="acct:acct_a"), 100),
    )
    assert decision.allowed
    assert decision.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-input-tokens": "200",
        "x-ratelimit-remaining-input-tokens": "100",
        "x-ratelimit-reset-input-tokens": "30s",
    }

    outputs = await take(rl, (otpm(90), 45))
    assert outputs.headers == {
        "x-ratelimit-limit-output-tokens": "90",
        "x-ratelimit-remaining-output-tokens": "45",
        "x-ratelimit-reset-output-tokens": "30s",
    }


async def test_remaining_is_floored(rl: Harness) -> None:
    bucket = itpm(60)
    assert (await take(rl, (bucket, 60))).allowed
    await rl.advance(2.5)
    decision = await take(rl, (bucket, 1))
    assert decision.allowed
    assert decision.headers["x-ratelimit-remaining-input-tokens"] == "1"  # 1.5 left
    assert decision.headers["x-ratelimit-reset-input-tokens"] == "59s"  # 58.5 s to full


async def test_charges_on_one_bucket_add_up(rl: Harness) -> None:
    bucket = rpm(3)
    assert not (await take(rl, (bucket, 2), (bucket, 2))).allowed
    assert (await take(rl, (bucket, 2), (bucket, 1))).allowed
    assert not (await take(rl, (bucket, 1))).allowed


async def test_no_charges_is_allowed_without_headers(rl: Harness) -> None:
    assert await rl.limiter.acquire([]) == Decision(True, None, 0, {})


# --- memory limiter only ---

def test_buckets_and_charges_are_validated() -> None:
    with pytest.raises(ValueError):
        Bucket("key:key_a", "requests", 0)
    with pytest.raises(ValueError):
        Bucket("key:key_a", "tokens", 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Charge(rpm(10), -1)


async def test_memory_limiter_forgets_buckets_once_they_are_full_again() -> None:
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock=clock)
    for i in range(100):
        await limiter.acquire([Charge(rpm(60, scope=f"key:key_{i}"), 1)])
    busy = rpm(60, scope="key:busy")
    await limiter.acquire([Charge(busy, 60)])

    clock.now += 61  # idle buckets are full again; `busy` spends again just before the sweep
    await limiter.acquire([Charge(busy, 0)])
    assert len(limiter._state) == 1  # only a bucket that is not full is remembered
    decision = await limiter.acquire([Charge(rpm(60, scope="key:key_0"), 0)])
    assert decision.headers["x-ratelimit-remaining-requests"] == "60"


def test_create_rate_limiter_picks_the_store() -> None:
    assert isinstance(create_rate_limiter(None), MemoryRateLimiter)
    assert isinstance(create_rate_limiter(""), MemoryRateLimiter)
    assert isinstance(create_rate_limiter(REDIS_URL), RedisRateLimiter)
