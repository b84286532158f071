"""What replicas tell each other is proportional to what changed: a delta per change, a small
heartbeat, and a full view only to a replica that asks — in as many messages as ``max_payload``
needs, never one bigger. Counted in messages and bytes on an in-memory NATS (``inprocess``)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.advertiser import FLUSH_DELAY
from darkbloom.coordinator.fabric.connection import PROOF_ROOM
from tests.coordinator.fabric.inprocess import SMALL, Bus, Replica, Sent, make_replica

def failed(reason: str) -> float:
    return REGISTRY.get_sample_value("darkbloom_fabric_publish_failed_total", {"reason": reason}) or 0.0


async def in_step(bus: Bus, size: int = 40) -> tuple[Replica, Replica]:
    """A holds ``size`` sessions; B joined after and sees them all."""
    a = make_replica(bus)
    await a.join()
    a.add(size)
    await bus.settle()
    b = make_replica(bus)
    await b.join()
    await bus.settle()
    assert len(b.stand_ins_of(a)) == size and not b.fabric.view.unsynced
    return a, b


async def test_a_joining_replica_sees_a_fleet_bigger_than_one_message(bus: Bus) -> None:
    a = make_replica(bus)
    await a.join()
    held = a.add(40)
    await bus.settle()
    b = make_replica(bus)
    mark = len(bus.sent)
    await b.join()
    await bus.settle()
    assert b.stand_ins_of(a) == {sim.id for sim in held}
    assert b.fabric.status() == {"nats": "connected", "replicas": 2, "fabric": "in_sync", "unsynced_replicas": []}
    assert a.fabric.status()["fabric"] == "in_sync" and a.fabric.view.heard[b.id].seq == 0
    sent = bus.since(mark)
    parts = [s for s in sent if s.kind == "view"]
    assert len(parts) > 5 and {s.subject for s in parts} == {b.fabric.subjects.my_views}
    assert sorted(s.body["part"] for s in parts) == list(range(len(parts)))
    assert sum(len(s.body["sessions"]) for s in parts) == 40
    # B asked everyone once and said it is alive; A answered with its view only
    assert [s.kind for s in sent if s.sender == b.id] == ["sync", "alive"]
    assert {s.kind for s in sent if s.sender == a.id} == {"view"}
    assert max(len(s.data) for s in bus.sent) <= SMALL


async def test_after_one_change_the_announcement_carries_that_change_only(bus: Bus) -> None:
    a, b = await in_step(bus)
    changed = next(iter(a.registry.held_here()))
    mark = len(bus.sent)
    a.registry.slots.claim(changed)
    await bus.settle()
    sent = bus.since(mark)
    assert [s.kind for s in sent] == ["delta"]
    delta = sent[0].body
    assert [s["id"] for s in delta["sessions"]] == [changed.id] and delta["gone"] == []
    assert len(sent[0].data) < 1500
    assert b.registry.get(changed.id).active == 1  # type: ignore[union-attr]

    mark = len(bus.sent)
    a.fabric.advertiser.alive()  # the heartbeat: a few dozen bytes for 40 sessions
    await bus.settle()
    sent = bus.since(mark)
    assert [s.kind for s in sent] == ["alive"] and len(sent[0].data) < PROOF_ROOM + 120
    assert sent[0].body["seq"] == b.fabric.view.heard[a.id].seq and sent[0].body["count"] == 40
    assert not b.fabric.view.unsynced

    mark = len(bus.sent)
    a.registry.remove(changed)
    await bus.settle()
    assert [(s.kind, s.body["sessions"], s.body["gone"]) for s in bus.since(mark)] == [("delta", [], [changed.id])]
    assert b.registry.get(changed.id) is None


async def test_a_lost_delta_is_repaired_by_a_full_view(bus: Bus) -> None:
    a, b = await in_step(bus, size=20)
    first, second = list(a.registry.held_here())[:2]
    bus.lose = lambda sent: sent.kind == "delta"
    first.start_draining()  # its delta never arrives
    await bus.settle()
    bus.lose = lambda sent: False
    assert not b.registry.get(first.id).draining  # type: ignore[union-attr]

    mark = len(bus.sent)
    a.registry.slots.claim(second)  # the next delta shows the gap
    await bus.settle()
    sent = bus.since(mark)
    assert [s.kind for s in sent if s.sender == b.id] == ["sync"]  # one ask, to A alone
    assert sent[[s.kind for s in sent].index("sync")].subject == a.fabric.subjects.my_views
    parts = [s for s in sent if s.kind == "view"]
    assert len(parts) == parts[0].body["parts"] > 1
    assert b.registry.get(first.id).draining and b.registry.get(second.id).active == 1  # type: ignore[union-attr]
    assert not b.fabric.view.unsynced and b.fabric.view.heard[a.id].seq == a.fabric.advertiser.seq


async def test_a_lost_last_delta_is_noticed_by_the_heartbeat(bus: Bus) -> None:
    a, b = await in_step(bus, size=10)
    gone = next(iter(a.registry.held_here()))
    bus.lose = lambda sent: sent.kind == "delta"
    a.registry.remove(gone)
    await bus.settle()
    bus.lose = lambda sent: False
    assert b.registry.get(gone.id) is not None
    a.fabric.advertiser.alive()
    await bus.settle()
    assert b.registry.get(gone.id) is None and len(b.stand_ins_of(a)) == 9 and not b.fabric.view.unsynced


async def test_a_count_that_disagrees_asks_for_the_view(bus: Bus) -> None:
    a, b = await in_step(bus, size=10)
    dropped = next(iter(b.stand_ins_of(a)))
    b.fabric.view.drop(dropped)  # as when A answered an attempt on it with "gone" too soon
    mark = len(bus.sent)
    a.fabric.advertiser.alive()
    await bus.settle()
    assert bus.since(mark, b.id) == []  # once may be a delta on its way
    a.fabric.advertiser.alive()
    await bus.settle()
    assert [s.kind for s in bus.since(mark, b.id)] == ["sync"]
    assert dropped in b.stand_ins_of(a) and len(b.stand_ins_of(a)) == 10


async def test_deltas_that_come_while_the_view_does_are_kept_and_applied_after(bus: Bus) -> None:
    a = make_replica(bus)
    await a.join()
    a.add(10)
    await bus.settle()
    b = make_replica(bus)
    held_back: list[Sent] = []

    def hold_back_views(sent: Sent) -> bool:
        if sent.kind == "view":
            held_back.append(sent)
            return True
        return False
    bus.lose = hold_back_views
    await b.join()
    await bus.settle()
    late = a.add(1)[0]
    await bus.settle()  # its delta reaches B before A's view does
    assert held_back and b.fabric.view.unsynced == [a.id] and b.fabric.status()["fabric"] == "out_of_sync"
    bus.lose = lambda sent: False
    a_client = next(client for client, _, _ in bus.subscriptions if client.replica == a.id)
    for sent in held_back:
        bus.publish(a_client, sent.subject, sent.data)
    await bus.settle()
    assert late.id in b.stand_ins_of(a) and len(b.stand_ins_of(a)) == 11 and not b.fabric.view.unsynced


async def test_answers_to_sync_requests_are_limited_per_asker(bus: Bus) -> None:
    a, b = await in_step(bus, size=10)
    a.fabric.advertiser.heartbeat = 3600.0  # one view per asker per heartbeat: the next is an hour away
    mark = len(bus.sent)
    for _ in range(10):
        a.fabric.view.apply(b.id, {"k": "sync", "replica": b.id})
    await bus.settle(owed=False)
    views = {s.body["view"] for s in bus.since(mark, a.id) if s.kind == "view"}
    assert len(views) <= 1 and b.id in a.fabric.advertiser._answer_later  # at most one now, one owed
    # a replica asks for itself only: naming another is refused, and nothing is sent to either
    mark = len(bus.sent)
    a.fabric.view.apply(b.id, {"k": "sync", "replica": "inst_someone_else"})
    await bus.settle(owed=False)
    assert bus.since(mark) == []


async def test_a_replica_speaks_only_for_itself_and_its_sessions_in_views_and_deltas(bus: Bus) -> None:
    a, b = await in_step(bus, size=3)
    c = make_replica(bus)
    await c.join()
    await bus.settle()
    theirs = next(iter(b.stand_ins_of(a)))
    ours = b.add(1)[0]
    forged = [messages.announcement(a.registry.get(theirs)), messages.announcement(ours.session)]  # type: ignore[arg-type]
    before = REGISTRY.get_sample_value("darkbloom_fabric_dropped_total", {"reason": "impersonation"}) or 0.0
    view = b.fabric.view
    view.apply(c.id, {"k": "delta", "replica": c.id, "seq": 1, "sessions": forged, "gone": [theirs]})
    view._out_of_step(view.heard[c.id])
    view.apply(c.id, {"k": "view", "replica": c.id, "seq": 5, "view": 1, "part": 0, "parts": 1, "sessions": forged})
    view.apply(c.id, {"k": "leaving", "replica": a.id})
    assert theirs in b.stand_ins_of(a) and b.registry.get(ours.id) is ours.session and not b.stand_ins_of(c)
    assert a.id in view.heard
    after = REGISTRY.get_sample_value("darkbloom_fabric_dropped_total", {"reason": "impersonation"})
    assert after == before + 5  # two sessions in the delta, two in the view, and the goodbye for A


async def test_no_message_is_bigger_than_max_payload(bus: Bus) -> None:
    a, b = await in_step(bus, size=3)
    before = failed("too_big")
    assert not a.fabric.connection.post(a.fabric.subjects.fleet, b"x" * SMALL)
    assert failed("too_big") == before + 1
    # a session whose announcement alone would not fit is not announced (and said so)
    huge = a.add(1, models=tuple(f"model-{i:04d}-{'x' * 40}" for i in range(100)))[0]
    await bus.settle()
    assert huge.id not in b.stand_ins_of(a) and a.fabric.advertiser.announced.keys() == {
        s.id for s in a.registry.held_here()} - {huge.id}
    a.fabric.advertiser.alive()
    await bus.settle()
    assert not b.fabric.view.unsynced  # the count said is that of what was announced
    assert max(len(s.data) for s in bus.sent) <= SMALL


async def test_a_publish_that_fails_is_counted(bus: Bus) -> None:
    a = make_replica(bus)
    before = failed("disconnected")
    assert not a.fabric.connection.post(a.fabric.subjects.fleet, b"{}")  # not connected yet
    assert failed("disconnected") == before + 1
    await a.join()
    await bus.settle()

    async def refuse(subject: str, data: bytes) -> None:
        raise ConnectionError("the server went away")
    a.fabric.connection.client.publish = refuse  # type: ignore[union-attr,method-assign]
    before = failed("nats_error")
    a.fabric.advertiser.alive()
    await bus.settle()
    assert failed("nats_error") == before + 1


async def test_a_passed_challenge_is_announced_and_renewals_leave_together_with_the_heartbeat(bus: Bus) -> None:
    """Stand-ins are not refreshed every second any more: a passed challenge is a change like any other,
    or after ``--challenge-freshness`` every stand-in would fail the challenge gate. A renewal of a pass
    that stays fresh for longer than a heartbeat waits for it, with every other renewal of that second."""
    a, b = await in_step(bus, size=3)
    first = a.add(1, challenge_age=None)[0].session  # registered, no challenge passed yet
    renewing = a.add(2, challenge_age=200.0)  # their last challenge passed 200 s ago
    await bus.settle()
    mark = len(bus.sent)
    first.record_challenge_pass(time.monotonic())  # a first pass: the others must know at once
    await bus.settle()
    assert [(s.kind, [x["id"] for x in s.body["sessions"]]) for s in bus.since(mark)] == [("delta", [first.id])]
    assert b.registry.get(first.id).challenge_passed_at is not None  # type: ignore[union-attr]

    stand_ins = [b.registry.get(sim.id) for sim in renewing]
    before = [s.challenge_passed_at for s in stand_ins]  # type: ignore[union-attr]
    mark = len(bus.sent)
    for sim in renewing:
        sim.session.record_challenge_pass(time.monotonic())  # the next round passed now
    await bus.settle()
    assert bus.since(mark) == []  # nothing until the heartbeat
    a.fabric.advertiser.alive()
    await bus.settle()
    sent = [(s.kind, sorted(x["id"] for x in s.body.get("sessions", []))) for s in bus.since(mark)]
    assert sent == [("delta", sorted(sim.id for sim in renewing)), ("alive", [])]
    assert all(s.challenge_passed_at - was > 150 for s, was in zip(stand_ins, before))  # type: ignore[union-attr,operator]


async def test_a_renewal_of_a_pass_about_to_go_stale_is_announced_at_once(bus: Bus) -> None:
    a, b = await in_step(bus, size=3)
    advertiser = a.fabric.advertiser
    # fresh for one heartbeat more: a stand-in left with it could fail the gate before the next delta
    session = a.add(1, challenge_age=advertiser.challenge_freshness - advertiser.heartbeat)[0].session
    await bus.settle()
    mark = len(bus.sent)
    session.record_challenge_pass(time.monotonic())
    await bus.settle()
    assert [(s.kind, [x["id"] for x in s.body["sessions"]]) for s in bus.since(mark)] == [("delta", [session.id])]


def test_an_announcement_reads_back_as_it_was_written_in_any_script() -> None:
    announced = {"id": "prov_1", "name": "Küche — 台所 🍳", "decode_tps": 12.5, "active": 2}
    encoded = messages.encoded(announced)
    assert "台所".encode() in encoded  # UTF-8 as it is, not \\u escapes: what max_payload counts is the text
    # (every integer an announcement carries fits 64 bits: orjson would read one past that as a float)
    unusual = {"id": "prov_2", "name": "台所", "size_bytes": 2**63 - 1}
    delta = messages.deltas("rep_a", 7, [encoded, messages.encoded(unusual)], ["prov_3"], 10_000)
    assert len(delta) == 1
    body = messages.json_object(delta[0])
    assert body["sessions"] == [announced, unusual] and body["gone"] == ["prov_3"] and body["seq"] == 7


async def test_a_change_of_load_alone_waits_longer_than_any_other_change(bus: Bus) -> None:
    a, _b = await in_step(bus)
    advertiser, loop = a.fabric.advertiser, asyncio.get_running_loop()
    session = next(iter(a.registry.held_here()))
    slot = a.registry.slots.claim(session)  # load only: leaves within LOAD_DELAY
    assert advertiser._flush_at is not None
    assert advertiser._flush_at.when() - loop.time() > FLUSH_DELAY
    session.start_draining()  # a fact: the delta already waiting leaves within FLUSH_DELAY
    assert advertiser._flush_at.when() - loop.time() <= FLUSH_DELAY
    await bus.settle()
    slot.release()
    assert advertiser._flush_at.when() - loop.time() > FLUSH_DELAY
    await bus.settle()
    assert advertiser._flush_at is None
