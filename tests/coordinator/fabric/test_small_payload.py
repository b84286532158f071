"""On a real NATS server whose ``max_payload`` is 4 kB (a second ``nats-server`` on a free port):
two in-process replicas over their real connections (nats-py, the server's limit read from it). A
replica that joins sees a fleet whose view takes many messages; one change is one delta; no message
on the server is bigger than its limit. Counted by a plain subscriber on the replicas' subjects."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import nats
import pytest

from tests.coordinator.fabric.inprocess import Bus, Replica, make_replica
from tests.support.processes import free_port

pytestmark = pytest.mark.e2e

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
SMALL = 4096


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {SMALL}\n")
    server = subprocess.Popen([NATS_SERVER, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


class Heard:
    """Every message on the replicas' subjects, as the server delivered it."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    async def on_message(self, msg: Any) -> None:
        self.messages.append((msg.subject, bytes(msg.data)))

    def kinds(self, since: int = 0) -> list[str]:
        return [json.loads(data.partition(b"\n")[2]).get("k", "?") if data.startswith(b"DBA1") else "?"
                for _, data in self.messages[since:]]


async def until(predicate: Any, what: str, timeout: float = 20) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@pytest.fixture
async def world(small_nats: str) -> AsyncIterator[tuple[Replica, Replica, Heard]]:
    bus = Bus()  # only introduces the replicas to each other: the messages go through the real server
    heard = Heard()
    spy = await nats.connect(small_nats, connect_timeout=5)
    tasks: list[asyncio.Task[None]] = []
    a = make_replica(bus, url=small_nats)
    b = make_replica(bus, url=small_nats)
    try:
        await spy.subscribe(a.fabric.subjects.prefix + ".>", cb=heard.on_message)
        tasks.append(asyncio.ensure_future(a.fabric.connection.run(a.fabric._subscribe)))
        await until(lambda: a.fabric.connected, "A connected")
        assert a.fabric.connection.max_payload == SMALL  # read from the server
        yield a, b, heard
    finally:
        for replica in (a, b):
            replica.close()
            for task in list(tasks):
                task.cancel()
            await replica.fabric.connection.close()
        await spy.close()


async def test_a_joining_replica_sees_a_fleet_bigger_than_max_payload_over_real_nats(
        world: tuple[Replica, Replica, Heard]) -> None:
    a, b, heard = world
    held = a.add(40)
    await until(lambda: len(a.fabric.advertiser.announced) == 40, "A announcing its sessions")
    writer = asyncio.ensure_future(b.fabric.connection.run(b.fabric._subscribe))
    try:
        await until(lambda: b.stand_ins_of(a) == {sim.id for sim in held}, "B seeing A's 40 sessions")
        assert b.fabric.status()["fabric"] == "in_sync"
        await until(lambda: "view" in heard.kinds(), "the spy hearing the view")
        assert heard.kinds().count("view") > 5  # 40 sessions of ~700 B in 4 kB messages
        assert max(len(data) for _, data in heard.messages) <= SMALL

        mark = len(heard.messages)
        a.registry.slots.claim(held[0].session)
        await until(lambda: b.registry.get(held[0].id).active == 1, "B seeing the claim")  # type: ignore[union-attr]
        await until(lambda: heard.kinds(mark), "the spy hearing the delta")
        assert heard.kinds(mark) == ["delta"]
    finally:
        writer.cancel()
