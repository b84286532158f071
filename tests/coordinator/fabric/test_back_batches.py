"""The holder sends the node's frames for one attempt that reach it in one loop turn as one NATS
message (as few as ``max_payload`` allows), and the admitting replica delivers every one of them, in
order. Counted in messages on an in-memory NATS (``inprocess``)."""

from __future__ import annotations

import json

from darkbloom.coordinator.fabric.holder import Forwarder, Hosted
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.wire.protocol import Envelope, Usage
from tests.coordinator.fabric.inprocess import SMALL, Bus, Replica, Sent, make_replica



class Collected:
    """An attempt's inbox on the admitting replica: what the stand-in delivered."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, object]] = []
        self.usages: list[Usage] = []

    def on_chunk(self, envelope: Envelope) -> bool:
        self.frames.append(("chunk", envelope.ciphertext))
        return True

    def on_complete(self, usage: Usage) -> bool:
        self.frames.append(("complete", usage.completion_tokens))
        self.usages.append(usage)
        return True

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        self.frames.append(("error", status))

    def on_provider_gone(self) -> None:
        self.frames.append(("gone", None))

    def unread(self) -> int:
        return 0


async def attempt(bus: Bus) -> tuple[Replica, Replica, Forwarder, Collected, str]:
    """An attempt admitted by B on A's session, dispatched: A's forwarder and B's inbox."""
    a = make_replica(bus)
    await a.join()
    session: ProviderSession = a.add(1, max_concurrency=2)[0].session
    b = make_replica(bus)
    await b.join()
    await bus.settle()
    stand_in = b.registry.get(session.id)
    assert stand_in is not None
    ticket, request_id = "t0ticket", "req_batched"
    b.fabric.outbound._placed[ticket] = (stand_in.link, request_id)  # type: ignore[assignment]
    inbox = Collected()
    stand_in.open_inbox(request_id, inbox)
    hosted = Hosted(ticket, b.id, a.registry.slots.claim(session))
    a.fabric.holder.hosted[ticket] = hosted
    hosted.forwarder = Forwarder(a.fabric.holder, hosted, request_id)
    session.open_inbox(request_id, hosted.forwarder)
    await bus.settle()
    return a, b, hosted.forwarder, inbox, b.fabric.subjects.back(b.id, ticket)


def items(sent: Sent) -> list[dict[str, object]]:
    return list(json.loads(sent.data.partition(b"\n")[2]))


async def test_the_frames_of_one_loop_turn_leave_in_one_message(bus: Bus) -> None:
    a, b, forwarder, inbox, subject = await attempt(bus)
    mark = len(bus.sent)
    for n in range(5):
        forwarder.on_chunk(Envelope(ephemeral_public_key="k", ciphertext=f"chunk{n}"))
    await bus.settle()
    back = [s for s in bus.since(mark) if s.subject == subject]
    assert len(back) == 1 and [item["k"] for item in items(back[0])] == ["chunk"] * 5
    assert inbox.frames == [("chunk", f"chunk{n}") for n in range(5)]

    mark = len(bus.sent)
    forwarder.on_chunk(Envelope(ephemeral_public_key="k", ciphertext="last words"))
    forwarder.on_complete(Usage(prompt_tokens=3, completion_tokens=6))  # in the same turn: the same message
    await bus.settle()
    back = [s for s in bus.since(mark) if s.subject == subject]
    assert len(back) == 1 and [item["k"] for item in items(back[0])] == ["chunk", "complete"]
    assert inbox.frames[-2:] == [("chunk", "last words"), ("complete", 6)]
    assert a.fabric.holder.hosted == {}


async def test_the_cached_tokens_reach_the_admitting_replica(bus: Bus) -> None:
    _a, _b, forwarder, inbox, _subject = await attempt(bus)
    forwarder.on_complete(Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=7))
    await bus.settle()
    assert inbox.usages == [Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=7)]


async def test_a_turn_bigger_than_max_payload_leaves_in_as_few_messages_as_fit(bus: Bus) -> None:
    a, b, forwarder, inbox, subject = await attempt(bus)
    mark = len(bus.sent)
    sent = [f"{n:02d}" + "x" * 1000 for n in range(12)]
    for text in sent:
        forwarder.on_chunk(Envelope(ephemeral_public_key="k", ciphertext=text))
    await bus.settle()
    back = [s for s in bus.since(mark) if s.subject == subject]
    assert 3 <= len(back) <= 4 and all(len(s.data) <= SMALL for s in back)  # 12 kB in 4 kB messages
    assert inbox.frames == [("chunk", text) for text in sent]
