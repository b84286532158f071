"""Several coordinator replicas of one coordinator, as real processes: one Postgres database, one
Redis, the machine's NATS server under a subject prefix of their own (so parallel test runs on one
NATS never hear each other), and a TCP proxy for pointing a node — or a replica's NATS connection —
at something a test can retarget or cut.

    with replica_set(root, 3) as replicas:     # fresh Postgres database, dropped afterwards
        a, b, c = replicas.coordinators
        replicas.kill(c)                        # SIGKILL: no goodbye on NATS
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from tests.support.databases import postgres_database
from tests.support.processes import Coordinator, start_coordinator, wait_until

NATS_URL = "nats://127.0.0.1:4222"
REDIS_URL = "redis://127.0.0.1:6379"
# short enough for tests to see a replica go within seconds; announcements are small
FAST = ("--replica-heartbeat", "0.3", "--replica-timeout", "1.5")
# The test id of a run across replicas, when a test runs on one coordinator and across replicas
# (tests/selfroute/conftest.py); tests/conftest.py gives a module's runs across replicas a worker of their own
ACROSS_REPLICAS = "across_replicas"


def subject_prefix() -> str:
    return "test" + secrets.token_hex(6)


@dataclass
class Replicas:
    root: Path
    database_url: str
    prefix: str = field(default_factory=subject_prefix)
    redis_url: str = field(default_factory=lambda: f"{REDIS_URL}/{secrets.randbelow(15) + 1}")
    args: tuple[str, ...] = ()
    coordinators: list[Coordinator] = field(default_factory=list)

    def start(self, *extra: str, nats_url: str = NATS_URL, name: str | None = None) -> Coordinator:
        """One more replica (``extra`` after the set's own arguments)."""
        name = name or f"replica{len(self.coordinators)}"
        coord = start_coordinator(self.root / name, self.database_url, "--redis-url", self.redis_url,
                                  "--nats-url", nats_url, "--nats-subject-prefix", self.prefix, *FAST,
                                  *self.args, *extra)
        self.coordinators.append(coord)
        return coord

    def kill(self, coord: Coordinator) -> None:
        coord.process.kill()

    def close(self) -> None:
        for coord in self.coordinators:
            coord.stop()

    def wait_joined(self, count: int | None = None, timeout: float = 30) -> None:
        """Until every running replica hears ``count`` replicas (itself included; default: all of them)."""
        running = [c for c in self.coordinators if c.process.proc.poll() is None]
        count = count or len(running)
        for coord in running:
            wait_until(lambda: readyz(coord).get("replicas") == count, timeout=timeout, interval=0.1,
                       what=f"{coord.base_url} hearing {count} replicas")


def readyz(coord: Coordinator) -> dict[str, object]:
    try:
        return dict(httpx.get(coord.base_url + "/readyz", timeout=5).json())
    except httpx.HTTPError:
        return {}


@contextlib.contextmanager
def replica_set(root: Path, count: int, *args: str) -> Iterator[Replicas]:
    """``count`` replicas on a fresh Postgres database, all hearing each other; stopped afterwards."""
    with postgres_database() as url:
        replicas = Replicas(root, url, args=args)
        try:
            for _ in range(count):
                replicas.start()
            replicas.wait_joined()
            yield replicas
        finally:
            replicas.close()


class TcpProxy:
    """127.0.0.1:``port`` forwarded to 127.0.0.1:``target``, on its own thread. ``retarget`` sends new
    connections elsewhere; ``cut`` closes the listener and every open connection (as a dead host
    would), ``resume`` listens again on the same port."""

    def __init__(self, target: int, port: int | None = None) -> None:
        self.port = port or 0  # 0: the first listen takes a port the system chooses
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.resume()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def retarget(self, target: int) -> None:
        self.target = target

    def resume(self) -> None:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port, reuse_address=True)
            self.port = int(self._server.sockets[0].getsockname()[1])
        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)

    def cut(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
