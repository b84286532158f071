"""Coordinator-added latency and throughput: the same fixed-response upstream called directly and
through coordinator + provider node (openai backend), non-streaming and streaming.

Run: .venv/bin/python bench/relay_overhead.py [--requests N]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.accounts import create_account, login_node, start_node, wait_model_listed  # noqa: E402
from tests.support.processes import free_port, spawn, start_coordinator, wait_until  # noqa: E402

MODEL = "bench-fixed"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "benchmark"}], "max_tokens": 16}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _one(client: httpx.AsyncClient, url: str, headers: dict[str, str], stream: bool) -> float:
    started = time.perf_counter()
    if stream:
        async with client.stream("POST", url, json={**BODY, "stream": True}, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for _ in response.aiter_bytes():
                pass
    else:
        response = await client.post(url, json=BODY, headers=headers)
        assert response.status_code == 200, response.text
    return time.perf_counter() - started


async def run_load(url: str, headers: dict[str, str], stream: bool, concurrency: int,
                   total: int) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for _ in range(min(concurrency, 8)):
            await _one(client, url, headers, stream)  # warm-up
        latencies: list[float] = []
        remaining = total

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                latencies.append(await _one(client, url, headers, stream))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return latencies, len(latencies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400, help="requests per (mode, concurrency) cell")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-"))
    upstream_port = free_port()
    upstream = spawn([sys.executable, str(ROOT / "bench" / "fixed_upstream.py"), str(upstream_port)],
                     root / "upstream", "upstream.log")
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [{"id": MODEL, "input_price": 1, "output_price": 1}]}))
    coord = start_coordinator(root / "coordinator", f"sqlite+aiosqlite:///{root / 'c.db'}",
                              "--catalog", str(catalog))
    node = None
    try:
        wait_until(lambda: _up(upstream_port), what="upstream")
        account = create_account(coord, credit_micro_usd=1_000_000_000)
        login_node(coord, root / "node", account)
        node = start_node(coord, root / "node", "--backend", "openai", "--upstream-url",
                          f"http://127.0.0.1:{upstream_port}", "--model", MODEL, "--max-concurrency", "128")
        wait_model_listed(coord, account, MODEL)
        direct = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        relayed = coord.api_url + "/chat/completions"
        print(f"# relay overhead — {time.strftime('%Y-%m-%d')} — {platform.node()} "
              f"({platform.processor() or platform.machine()}, {_cpus()} cores), {args.requests} requests per cell")
        print("| mode | conc | direct p50 ms | direct p99 ms | relayed p50 ms | relayed p99 ms "
              "| added p50 ms | added p99 ms | direct req/s | relayed req/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for stream in (False, True):
            for concurrency in (1, 16, 64):
                d_lat, d_rps = asyncio.run(run_load(direct, {}, stream, concurrency, args.requests))
                r_lat, r_rps = asyncio.run(run_load(relayed, account.headers(), stream, concurrency, args.requests))
                dp50, dp99 = percentile(d_lat, 0.5) * 1e3, percentile(d_lat, 0.99) * 1e3
                rp50, rp99 = percentile(r_lat, 0.5) * 1e3, percentile(r_lat, 0.99) * 1e3
                print(f"| {'stream' if stream else 'plain'} | {concurrency} | {dp50:.1f} | {dp99:.1f} | {rp50:.1f} "
                      f"| {rp99:.1f} | {rp50 - dp50:.1f} | {rp99 - dp99:.1f} | {d_rps:.0f} | {r_rps:.0f} |",
                      flush=True)
    finally:
        if node is not None:
            node.stop()
        coord.stop()
        upstream.stop()


def _up(port: int) -> bool:
    try:
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def _cpus() -> int:
    import os
    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
