"""The Flusher both periodic writers build on (the machine book, the machine insight): rounds only when
woken, a failed round retried, a stop that lets a write end but not forever, a last write that never
raises out of the shutdown."""

from __future__ import annotations

import asyncio
import logging

import pytest

from darkbloom.coordinator.fleet.flusher import Flusher

log = logging.getLogger("tests.flusher")


class Writes:
    def __init__(self, fail: int = 0) -> None:
        self.calls: list[str] = []
        self.fail = fail  # the first this many writes raise

    async def write(self, label: str = "round") -> None:
        self.calls.append(label)
        if len(self.calls) <= self.fail:
            raise OSError("database unreachable")


async def test_a_flusher_with_a_wake_event_writes_nothing_until_it_is_set() -> None:
    writes, wake = Writes(), asyncio.Event()
    flusher = Flusher("t", writes.write, 0.001, log=log, what=lambda: "things", wake=wake)
    flusher.start()
    await asyncio.sleep(0.05)
    assert writes.calls == []
    wake.set()
    for _ in range(200):
        if writes.calls:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    assert writes.calls == ["round"] and not wake.is_set()  # one round per wake, and it cleared the event
    await flusher.close()
    assert writes.calls == ["round", "round"]  # and the last write


async def test_a_failed_round_is_logged_and_the_next_round_writes_again(caplog: pytest.LogCaptureFixture) -> None:
    writes = Writes(fail=1)
    flusher = Flusher("t", writes.write, 0.001, log=log, what=lambda: "3 things")
    flusher.start()
    for _ in range(200):
        if len(writes.calls) >= 2:
            break
        await asyncio.sleep(0.005)
    await flusher.close()
    assert len(writes.calls) >= 3  # the failed round, at least one more, the last write
    assert "could not record 3 things (OSError('database unreachable')); retrying in 0.001 s" in caplog.text


async def test_stopping_cancels_a_write_stuck_past_its_patience_then_writes_once_more() -> None:
    entered, calls = asyncio.Event(), []

    async def stuck() -> None:
        calls.append("round")
        entered.set()
        await asyncio.Event().wait()  # a database that never answers

    async def last() -> None:
        calls.append("last")

    flusher = Flusher("t", stuck, 0.001, log=log, what=lambda: "things", last_write=last, patience=0.05)
    flusher.start()
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(flusher.close(), 5)  # bounded: not the stuck write's forever
    assert calls == ["round", "last"]


async def test_a_last_write_that_fails_is_logged_and_does_not_stop_the_shutdown(
        caplog: pytest.LogCaptureFixture) -> None:
    writes = Writes(fail=1)
    flusher = Flusher("t", writes.write, 3600, log=log, what=lambda: "7 machines")
    flusher.start()
    await flusher.close()
    assert writes.calls == ["round"]
    assert "could not record 7 machines at shutdown" in caplog.text
