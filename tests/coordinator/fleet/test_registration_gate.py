"""The registration gate over real sockets: a socket beyond the registrations in flight is closed at
once with 1013 (try again later), and a place is given back when its registration completes or its
socket goes before that."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest
from websockets.exceptions import ConnectionClosed

from darkbloom.wire.protocol import dump
from tests.coordinator.fleet.conftest import LiveCoordinator
from tests.support.raw_provider import RawProvider

pytestmark = pytest.mark.e2e

TRY_AGAIN_LATER = 1013


async def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_socket_beyond_the_limit_is_told_to_try_again_later(
        live_coordinator: Callable[..., LiveCoordinator]) -> None:
    coord = live_coordinator()
    gate = coord.services.registrations
    gate.limit = 1
    waiting = RawProvider(coord.base_url, challenge_answer="ignore")  # holds the one place: never answers
    ws = await waiting.connect()
    await ws.send(dump(waiting.register_frame()))
    await until(lambda: gate.in_flight == 1, "the first registration in flight")

    turned_away = RawProvider(coord.base_url)
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(turned_away.register(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == TRY_AGAIN_LATER

    await waiting.close()  # gone before its registration completed: its place is given back
    await until(lambda: gate.in_flight == 0, "the place to be given back")
    admitted = RawProvider(coord.base_url)
    registered = await asyncio.wait_for(admitted.register(), 10)
    assert registered["type"] == "registered"
    assert gate.in_flight == 0  # registered: no longer in flight, though its socket stays open
    await admitted.close()
