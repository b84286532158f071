"""The node tells its reconnect policy how each connection ended (against a scripted fake
coordinator); the policy's delays themselves are test_reconnect's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import pytest

from darkbloom.provider.reconnect import SERVICE_RESTART, TRY_AGAIN_LATER, ReconnectPolicy
from darkbloom.wire import protocol
from tests.provider.fake_coordinator import FakeCoordinator, running_node
from tests.support.processes import free_port


@dataclass
class RecordingPolicy(ReconnectPolicy):
    """The real policy with short delays, keeping every outcome it was told."""

    base: float = 0.01
    restart_window: float = 0.01
    lost_window: float = 0.01
    outcomes: list[tuple[bool, int | None]] = field(default_factory=list)

    def delay(self, registered: bool, close_code: int | None) -> float:
        self.outcomes.append((registered, close_code))
        return super().delay(registered, close_code)


async def until(predicate: object, what: str) -> None:
    for _ in range(1000):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def node_on_fake(home: Path) -> AsyncIterator[tuple[FakeCoordinator, RecordingPolicy]]:
    policy = RecordingPolicy()
    async with FakeCoordinator() as fake, running_node(fake.url, home, policy):
        yield fake, policy


async def test_the_policy_hears_restart_try_again_later_and_a_lost_session(
        node_on_fake: tuple[FakeCoordinator, RecordingPolicy]) -> None:
    fake, policy = node_on_fake
    conn = await fake.accept()
    await conn.recv_type(protocol.Register)
    await conn.send(protocol.Registered(provider_id="prov_1", trust_level="self_signed"))
    await conn.ws.close(SERVICE_RESTART, "service restart")
    await until(lambda: len(policy.outcomes) == 1, "the first outcome")

    conn = await fake.accept()
    await conn.recv_type(protocol.Register)
    await conn.ws.close(TRY_AGAIN_LATER, "try again later")  # before `registered`
    await until(lambda: len(policy.outcomes) == 2, "the second outcome")

    conn = await fake.accept()
    await conn.recv_type(protocol.Register)
    await conn.send(protocol.Registered(provider_id="prov_2", trust_level="self_signed"))
    await conn.recv_type(protocol.Heartbeat)  # registered and serving
    assert conn.ws.transport is not None
    conn.ws.transport.abort()  # no close frame
    await until(lambda: len(policy.outcomes) == 3, "the third outcome")

    assert policy.outcomes == [(True, SERVICE_RESTART), (False, TRY_AGAIN_LATER), (True, 1006)]
    assert policy.failures == 0


async def test_refused_connections_count_as_failures(home: Path) -> None:
    policy = RecordingPolicy()
    async with running_node(f"http://127.0.0.1:{free_port()}", home, policy):  # nobody listens there
        await until(lambda: len(policy.outcomes) >= 3, "three refused attempts")
    assert set(policy.outcomes) == {(False, None)}
    assert policy.failures >= 3
