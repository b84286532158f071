"""The in-process bus the announcement and back-batching tests run on (tests/coordinator/fabric/inprocess.py)."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from tests.coordinator.fabric.inprocess import SMALL, Bus


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    bus = Bus(max_payload=SMALL)
    yield bus
    for replica in bus.replicas:
        replica.close()
    assert not bus.oversize, "a message bigger than max_payload reached the bus"
