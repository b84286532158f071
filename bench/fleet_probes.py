"""What bench/fleet_scale.py reads from outside the coordinator: CPU and RSS from /proc, latencies of
sequential HTTP requests, Prometheus gauges, the Postgres backends of one database, and the bytes
the replicas publish on NATS (counted by a subscriber of their subjects: monitoring may be off)."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(found.group(1)) * 1024 if found else 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Latencies:
    seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def ms(self, q: float) -> float:
        return 1e3 * percentile(self.seconds, q)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


def sequential(send: Callable[[httpx.Client], httpx.Response], count: int, budget: float,
               gap: float = 0.0, ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200) -> Latencies:
    """Up to ``count`` requests one after the other on one keep-alive connection, stopping after
    ``budget`` seconds; each timed from send to the whole body read."""
    result = Latencies()
    deadline = time.monotonic() + budget
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            started = time.perf_counter()
            try:
                response = send(client)
            except httpx.HTTPError as exc:
                result.fail(type(exc).__name__)
                continue
            if ok(response):
                result.seconds.append(time.perf_counter() - started)
            else:
                result.fail(f"HTTP {response.status_code}")
            if gap:
                time.sleep(gap)
    return result


def gauge(base_url: str, name: str) -> float | None:
    try:
        text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return None
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def counter_sum(base_url: str, name: str) -> float:
    """A counter summed over its labels (0 when absent)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class PostgresBackends:
    """CPU of the Postgres server processes serving one database (pids from pg_stat_activity, CPU from
    /proc): the part of a registration or of idle bookkeeping that the database pays. A backend that
    exits between two readings takes its CPU with it, so this is a lower bound."""

    def __init__(self, admin_dsn: str, database: str) -> None:
        self.admin_dsn = admin_dsn
        self.database = database

    def pids(self) -> list[int]:
        async def query() -> list[int]:
            conn = await asyncpg.connect(self.admin_dsn)
            try:
                rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", self.database)
            finally:
                await conn.close()
            return [int(r["pid"]) for r in rows]
        return asyncio.run(query())

    def cpu(self) -> dict[int, float] | None:
        """CPU seconds per backend now; None when Postgres refuses the query (too many clients)."""
        try:
            return {pid: cpu_seconds(pid) for pid in self.pids()}
        except (OSError, asyncpg.PostgresError):
            return None

    @staticmethod
    def spent(before: dict[int, float] | None, after: dict[int, float] | None) -> float:
        if before is None or after is None:
            return float("nan")
        return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


class NatsCounter:
    """Counts the messages and payload bytes published under ``<prefix>.>`` (what every replica's
    subscription is offered), on its own thread and loop."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.messages = 0
        self.bytes = 0
        self.largest = 0
        self.fleet_bytes = 0
        self.max_payload = 0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> NatsCounter:
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError(f"cannot subscribe to {self.url}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def reading(self) -> tuple[float, int, int]:
        """(monotonic time, messages, bytes) now."""
        return time.monotonic(), self.messages, self.bytes

    async def _run(self) -> None:
        import nats

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        client = await nats.connect(self.url, name="fleet-bench-counter")
        self.max_payload = client.max_payload
        fleet = f"{self.prefix}.fleet"

        async def count(msg: object) -> None:
            size = len(msg.data)  # type: ignore[attr-defined]
            self.messages += 1
            self.bytes += size
            self.largest = max(self.largest, size)
            if msg.subject == fleet:  # type: ignore[attr-defined]
                self.fleet_bytes += size

        await client.subscribe(f"{self.prefix}.>", cb=count)
        await client.flush()
        self._ready.set()
        await self._stop.wait()
        await client.close()

