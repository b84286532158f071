"""The relay lets the event loop run while it drains a queue of many chunks (issue 19, row 2): a
provider that sends chunks faster than they are relayed never holds the loop, streamed or not, and
a flood does not outlive the request deadline. A ticker task counts how often the loop ran others
while the relay worked through the queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from darkbloom.coordinator.inference.attempts import Attempt
from darkbloom.coordinator.inference.calls import Deadlines
from darkbloom.coordinator.fleet.slots import Slots
from darkbloom.wire.openai.presenters import ChatPresenter
from darkbloom.wire.protocol import Usage
from tests.coordinator.routing.sim import SimProvider

CHUNKS = 5_000


def _chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def _flooded(*, head: int = 0, queued: int = CHUNKS, complete: bool = True) -> Attempt:
    pending = Attempt("chatcmpl-drain", Slots().claim(SimProvider().session))
    pending.head.extend(_chunk("h") for _ in range(head))
    for _ in range(queued):
        pending.events.put_nowait(_chunk("x"))
    if complete:
        pending.usage = Usage(prompt_tokens=1, completion_tokens=queued)
        pending.events.put_nowait(pending.usage)
    return pending


async def _ticks_while(work: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    ticks = 0
    try:
        result = await work()
    finally:
        stop = True
        await task
    return ticks, result


def _deadlines(seconds: float = 60.0) -> Deadlines:
    return Deadlines(idle=seconds, until=time.monotonic() + seconds)


async def _streamed(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([part async for part in stream])


async def test_collect_lets_the_loop_run_while_it_drains() -> None:
    pending = _flooded(head=CHUNKS)
    presenter = ChatPresenter("chatcmpl-1", "m", {})
    ticks, _ = await _ticks_while(lambda: pending.collect(False, presenter, _deadlines()))
    assert pending.usage is not None
    body = presenter.response(pending.usage)
    assert body["choices"][0]["message"]["content"] == "h" * CHUNKS + "x" * CHUNKS
    assert ticks >= (2 * CHUNKS) // 64 - 2


async def test_a_stream_lets_the_loop_run_and_writes_as_it_goes() -> None:
    pending = _flooded(head=CHUNKS)
    writes: list[bytes] = []

    async def drain() -> None:
        async for part in pending.relay(False, ChatPresenter("chatcmpl-1", "m", {}), _deadlines()):
            writes.append(part)

    ticks, _ = await _ticks_while(drain)
    assert ticks >= (2 * CHUNKS) // 64 - 2
    assert len(writes) > 1  # not one write of every chunk at the end
    assert b"".join(writes).count(b"data: ") == 2 * CHUNKS


async def test_a_flood_past_the_request_deadline_is_stopped() -> None:
    pending = _flooded(queued=CHUNKS, complete=False)
    presenter = ChatPresenter("chatcmpl-1", "m", {})
    out = await _streamed(pending.relay(False, presenter, Deadlines(idle=60, until=0.0)))
    assert pending.failure is not None and pending.failure.reason == "provider_timeout"
    assert out.count(b"data: ") < 64  # stopped at the first look at the clock
