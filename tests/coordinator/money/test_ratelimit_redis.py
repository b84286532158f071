"""Redis rate limits shared between limiters and OS processes, on the machine's Redis.

A bucket of 50 per minute refills 50/60 of a token per second, so the counts below allow the
refill that the measured elapsed time permits on top of the 50 a full bucket holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import pytest

from darkbloom.coordinator.money.ratelimit import (
    Bucket,
    Charge,
    RateLimiterUnavailable,
    RedisRateLimiter,
)
from tests.coordinator.money.test_ratelimit import REDIS_URL, redis_prefix

LIMIT = 50


def most_admitted(elapsed_seconds: float) -> int:
    return LIMIT + int(elapsed_seconds * LIMIT / 60)


async def test_concurrent_acquires_from_several_limiters_admit_exactly_the_bucket() -> None:
    async with redis_prefix() as (_, prefix):
        limiters = [RedisRateLimiter(REDIS_URL, prefix=prefix) for _ in range(4)]
        bucket = Bucket("acct:acct_shared", "requests", LIMIT)
        try:
            started = time.monotonic()
            decisions = await asyncio.gather(*(
                limiters[i % len(limiters)].acquire([Charge(bucket, 1)]) for i in range(200)
            ))
            elapsed = time.monotonic() - started
        finally:
            for limiter in limiters:
                await limiter.close()

    admitted = sum(d.allowed for d in decisions)
    assert LIMIT <= admitted <= most_admitted(elapsed)
    assert all(d.failed == bucket and d.retry_after_seconds >= 1 for d in decisions if not d.allowed)


async def test_concurrent_multi_bucket_acquires_debit_every_bucket_once_per_admission() -> None:
    async with redis_prefix() as (client, prefix):
        limiter = RedisRateLimiter(REDIS_URL, prefix=prefix)
        requests = Bucket("key:key_a", "requests", 30)  # 0.5 per second
        tokens = Bucket("acct:acct_a", "input_tokens", 600)  # 10 per second: 20 charges of 30
        try:
            started = time.monotonic()
            decisions = await asyncio.gather(*(
                limiter.acquire([Charge(requests, 1), Charge(tokens, 30)]) for _ in range(100)
            ))
            levels = [int(await client.hget(limiter.key(b), "level") or 0) / 60_000_000
                      for b in (requests, tokens)]
            elapsed = time.monotonic() - started
        finally:
            await limiter.close()

    admitted = sum(d.allowed for d in decisions)
    assert 20 <= admitted <= 20 + int(elapsed * 10 / 30)
    assert all(d.failed == tokens for d in decisions if not d.allowed)
    # Each bucket lost exactly one charge per admitted request and nothing for a refused one.
    assert 30 - admitted <= levels[0] <= 30 - admitted + elapsed * 0.5
    assert 600 - 30 * admitted <= levels[1] <= 600 - 30 * admitted + elapsed * 10


_HAMMER = """
import asyncio, json, sys, time
from darkbloom.coordinator.money.ratelimit import Bucket, Charge, RedisRateLimiter

async def main(url: str, prefix: str, attempts: int) -> None:
    limiters = [RedisRateLimiter(url, prefix=prefix) for _ in range(2)]
    bucket = Bucket("acct:acct_shared", "requests", int(sys.argv[4]))
    for limiter in limiters:  # connect and load the script before the start signal
        await limiter.acquire([Charge(bucket, 0)])
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.time()
    decisions = await asyncio.gather(*(
        limiters[i % 2].acquire([Charge(bucket, 1)]) for i in range(attempts)
    ))
    finished = time.time()
    for limiter in limiters:
        await limiter.close()
    print(json.dumps({"admitted": sum(d.allowed for d in decisions),
                      "started": started, "finished": finished}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_two_processes_share_one_bucket() -> None:
    async with redis_prefix() as (_, prefix):
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", _HAMMER, REDIS_URL, prefix, "150", str(LIMIT),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )
            for _ in range(2)
        ]
        try:
            for proc in procs:
                assert proc.stdout is not None
                assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
            outputs = await asyncio.wait_for(
                asyncio.gather(*(proc.communicate(b"go\n") for proc in procs)), 60)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    assert all(proc.returncode == 0 for proc in procs)
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    admitted = sum(r["admitted"] for r in results)
    # Buckets start full when first touched (at the processes' warm-up), so only refill after the
    # earliest start can add to the 50.
    elapsed = max(r["finished"] for r in results) - min(r["started"] for r in results)
    assert LIMIT <= admitted <= most_admitted(elapsed)


async def test_unreachable_redis_refuses_to_admit() -> None:
    limiter = RedisRateLimiter("redis://127.0.0.1:1/0")
    try:
        with pytest.raises(RateLimiterUnavailable, match="Redis"):
            await limiter.acquire([Charge(Bucket("key:key_a", "requests", 10), 1)])
    finally:
        await limiter.close()


async def test_refund_on_unreachable_redis_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    limiter = RedisRateLimiter("redis://127.0.0.1:1/0")
    try:
        with caplog.at_level(logging.WARNING, logger="darkbloom.ratelimit"):
            await limiter.refund([Charge(Bucket("key:key_a", "output_tokens", 10), 5)])
    finally:
        await limiter.close()
    assert "refund failed" in caplog.text


async def test_buckets_use_the_server_clock_and_expire_when_idle() -> None:
    async with redis_prefix() as (client, prefix):
        limiter = RedisRateLimiter(REDIS_URL, prefix=prefix)
        bucket = Bucket("key:key_a", "output_tokens", 600)
        try:
            await limiter.acquire([Charge(bucket, 300)])  # 30 s from full
            seconds, micros = await client.time()
            stamped = int(await client.hget(limiter.key(bucket), "at") or 0)
            ttl_ms = await client.pttl(limiter.key(bucket))
        finally:
            await limiter.close()

    assert abs(stamped - (seconds * 1_000_000 + micros)) < 5_000_000
    assert 145_000 < ttl_ms <= 150_000  # 30 s to refill, then two idle minutes
