"""What the hostile-provider suites share: a priced model only a test's raw providers serve, the
caller's balance settling and usage rows, sealed plaintext of any bytes, a socket dropped as a
crashed node drops it, and a /health watcher."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from typing import Any

import httpx

from darkbloom.wire.protocol import InferenceRequest, InferenceResponseChunk, dump
from tests.support.accounts import Account, balance
from tests.support.processes import Coordinator
from tests.support.raw_provider import RawProvider


def new_model(coord: Coordinator, prefix: str = "hostile") -> str:
    model = f"{prefix}-{secrets.token_hex(4)}"
    catalog = httpx.get(coord.api_url + "/admin/catalog", headers=coord.admin()).json()
    catalog["models"].append({"id": model, "input_price": 1_000, "output_price": 1_000})
    httpx.put(coord.api_url + "/admin/catalog", json=catalog, headers=coord.admin()).raise_for_status()
    return model


async def balance_settles_at(coord: Coordinator, account: Account, expected: int) -> None:
    deadline = time.monotonic() + 10
    while balance(coord, account) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert balance(coord, account) == expected


def usage_ids(coord: Coordinator, account: Account) -> set[str]:
    rows = httpx.get(coord.api_url + "/payments/usage", headers=account.headers()).json()["data"]
    return {row["request_id"] for row in rows}


async def registered(coord: Coordinator, model: str, capabilities: tuple[str, ...] = (),
                     auth_token: str | None = None) -> RawProvider:
    raw = RawProvider(coord.base_url, models=(model,), capabilities=capabilities, auth_token=auth_token)
    await raw.register()
    return raw


async def send_plaintext(raw: RawProvider, request: InferenceRequest, plaintext: bytes) -> None:
    """Any bytes, sealed as this provider seals a chunk."""
    assert raw.ws is not None
    await raw.ws.send(dump(InferenceResponseChunk(request_id=request.request_id,
                                                  encrypted_data=raw.sealer(request).seal(plaintext))))


async def crash_on_request(raw: RawProvider) -> str:
    """Wait for a request and drop the socket on it, as a node that died on it does; its id."""
    request, _ = await raw.next_request()
    assert raw.ws is not None
    raw.ws.transport.abort()
    return request.request_id


_HEALTH_LOOP = """
import sys, time, httpx
with httpx.Client(timeout=60) as http:
    while True:
        started = time.perf_counter()
        status = http.get(sys.argv[1]).status_code
        print(status, time.perf_counter() - started, flush=True)
"""


class HealthWatch:
    """Asks /health over and over, one at a time, from a process of its own (so nothing the test
    does delays it), until stopped; each answer's status and latency."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.answers: list[tuple[int, float]] = []
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> "HealthWatch":
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _HEALTH_LOOP, self.coord.base_url + "/health", stdout=asyncio.subprocess.PIPE)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        async for line in self._process.stdout:
            status, latency = line.split()
            self.answers.append((int(status), float(latency)))

    async def answered(self, count: int, timeout: float = 30) -> None:
        """Until ``count`` more answers came back."""
        deadline = time.monotonic() + timeout
        start = len(self.answers)
        while len(self.answers) < start + count:
            assert time.monotonic() < deadline, "/health stopped answering"
            await asyncio.sleep(0.005)

    async def stop(self, what: str) -> list[tuple[int, float]]:
        assert self._process is not None and self._reader is not None
        self._process.kill()
        await self._process.wait()
        await asyncio.gather(self._reader, return_exceptions=True)
        worst = max((latency for _, latency in self.answers), default=0.0)
        print(f"{what}: {len(self.answers)} /health answers, the slowest in {worst * 1000:.1f} ms")
        return self.answers


def sse_data(text: str) -> list[Any]:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]
