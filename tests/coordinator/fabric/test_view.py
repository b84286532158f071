"""The fleet view without processes: another replica's announcements become stand-ins in this
replica's registry that the gates, the scheduler and the owned views see as they see a local
session; a full view, a goodbye and silence take them away; the one-way facts (unlinked,
draining, untrusted) never go back; a frame too big for one NATS message arrives whole; placement
takes a session held here over another replica's that ranks no better."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import REGISTRY

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fabric.authentication import Authenticator, ReplicaKey, Roster
from darkbloom.coordinator.fabric.connection import Connection
from darkbloom.coordinator.fabric.holder import Holder
from darkbloom.coordinator.fabric.remote_link import Outbound, RemoteLink
from darkbloom.coordinator.fabric.subjects import Subjects
from darkbloom.coordinator.fabric.view import FleetView
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.routing.gates import first_failed_gate
from darkbloom.coordinator.routing.model_views import owned_models
from darkbloom.coordinator.routing.scheduler import select, select_idle_or_free
from darkbloom.wire.protocol import Cancel, Envelope, Hardware, InferenceRequest, dump
from tests.coordinator.routing.sim import MODEL, SimProvider, services, settings

HOLDER = "inst_holder"


def authenticator(replica: str) -> Authenticator:
    return Authenticator(Roster(ReplicaKey(replica), engine=None, stale_after=30))  # type: ignore[arg-type]


def view_of_b(**fields: object) -> tuple[FleetView, Registry, list[str]]:
    registry = Registry()
    svc = services(registry, settings(replica_timeout=3.0, **fields))
    outbound = Outbound(Connection("nats://127.0.0.1:1", "test", authenticator("inst_b")), Subjects("t", "inst_b"),
                        registry)
    gone: list[str] = []
    return FleetView(svc, outbound, gone.append), registry, gone


_views = itertools.count(1)


def announce(view: FleetView, *sims: SimProvider, **changes: object) -> None:
    """The holder's full view: these sessions (with ``changes``), and no other."""
    sessions = [{**messages.announcement(sim.session), **changes} for sim in sims]
    heard = view.heard.get(HOLDER)
    if heard is not None:
        view._out_of_step(heard)
    number = next(_views)
    view.apply(HOLDER, {"k": "view", "replica": HOLDER, "seq": number, "view": number, "part": 0, "parts": 1,
                        "sessions": sessions})


async def test_an_announced_session_is_routable_here() -> None:
    view, registry, _ = view_of_b()
    sim = SimProvider(account="acct_owner", machine="mach_1", max_concurrency=2, decode_tps=12.0)
    sim.session.registration = sim.session.registration.model_copy(
        update={"hardware": Hardware(cpu_count=8, device="cuda", backend="llama-cpp")})
    announce(view, sim)
    stand_in = registry.get(sim.session.id)
    assert stand_in is not None and isinstance(stand_in.link, RemoteLink) and stand_in.link.holder == HOLDER
    assert stand_in.registration.auth_token is None  # a device token never crosses the fabric
    # where it runs its models, for /v1/me/providers on any replica (unknown from one that does not say)
    assert stand_in.registration.hardware == Hardware(device="cuda", backend="llama-cpp")
    older = {k: v for k, v in messages.announcement(sim.session).items() if k not in ("device", "backend")}
    assert messages.registration_of(older).hardware == Hardware()
    public = RouteDecision(model=MODEL)
    assert first_failed_gate(stand_in, public, view.services.settings, 0.0 + stand_in.challenge_passed_at) is None
    assert select(registry, public, view.services.settings) is stand_in
    assert registry.for_machine("mach_1") == {stand_in}
    assert owned_models(view.services, "acct_owner") == {MODEL.id: "darkbloom"}
    slot = registry.slots.claim(stand_in)
    assert slot.ticket is not None and stand_in.active == 1
    announce(view, sim)  # the holder's count wins (its announcement includes every replica's claims)
    assert stand_in.active == 0
    slot.release()
    assert stand_in.active == 0


async def test_full_announcement_goodbye_and_silence_drop_stand_ins() -> None:
    view, registry, gone = view_of_b()
    first, second = SimProvider(), SimProvider()
    announce(view, first, second)
    assert len(registry) == 2
    announce(view, second)  # a full view without it: it left
    assert registry.get(first.session.id) is None and len(registry) == 1
    view.apply(HOLDER, {"k": "leaving", "replica": HOLDER})
    assert len(registry) == 0 and gone == [HOLDER]
    announce(view, first)
    view.heard[HOLDER].heard_at -= 10  # silent longer than --replica-timeout
    view.replica_gone(HOLDER, "test")
    assert len(registry) == 0


async def test_one_way_facts_never_go_back() -> None:
    view, registry, _ = view_of_b()
    sim = SimProvider(account="acct_owner", machine="mach_1")
    announce(view, sim)
    stand_in = registry.get(sim.session.id)
    assert stand_in is not None
    announce(view, sim, account_id=None, draining=True, untrusted_reason="bad chunk")
    assert stand_in.account_id is None and stand_in.draining and stand_in.untrusted_reason == "bad chunk"
    assert registry.owned_by("acct_owner") == set()
    announce(view, sim)  # an announcement sent before the change cannot undo it
    assert stand_in.account_id is None and stand_in.draining and stand_in.untrusted_reason == "bad chunk"


@pytest.mark.parametrize("size", [0, 10, 5000])
def test_a_request_frame_bigger_than_max_payload_arrives_whole(size: int) -> None:
    frame = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    parts = messages.hold_parts("request", frame, messages.HEADER_ROOM + 1000, t="abc", s="prov_1", r="r", f="f")
    assert len(parts) == max(1, -(-size // 1000))
    holder = Holder(None, None, Subjects("t", "inst_a"))  # type: ignore[arg-type]
    whole = None
    for part in parts:
        header, payload = messages.read_hold(part)
        whole = holder.split_frames.add("f", header, payload)
    assert whole == frame


def test_a_split_frame_missing_a_part_or_from_a_gone_replica_is_not_kept() -> None:
    frame = b"y" * 5000
    parts = [messages.read_hold(p) for p in
             messages.hold_parts("request", frame, messages.HEADER_ROOM + 1000, t="abc", s="prov_1", r="r", f="inst_b")]
    holder = Holder(None, None, Subjects("t", "inst_a"))  # type: ignore[arg-type]
    holder.split_frames.add("inst_b", *parts[0])
    assert holder.split_frames.add("inst_b", *parts[2]) is None and not holder.split_frames  # part 1 lost: dropped, not kept forever
    holder.split_frames.add("inst_b", *parts[0])
    holder.admitter_gone("inst_b")  # its admitter died mid-send: the rest never comes
    assert not holder.split_frames
    header, payload = parts[0]
    assert holder.split_frames.add("inst_b", {**header, "n": 10_000}, payload) is None and not holder.split_frames  # absurd part counts


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("darkbloom_fabric_dropped_total", {"reason": reason}) or 0.0


async def test_a_replica_speaks_only_for_itself_and_its_own_sessions() -> None:
    view, registry, gone = view_of_b()
    theirs, ours = SimProvider(), SimProvider()
    announce(view, theirs)
    registry.add(ours.session)  # a session of this replica's
    before = dropped("impersonation")
    sessions = [messages.announcement(theirs.session)]
    view.apply("inst_other", {"k": "leaving", "replica": HOLDER})
    view.apply("inst_other", {"k": "delta", "replica": "inst_other", "seq": 1, "sessions": sessions, "gone": []})
    view.apply("inst_other", {"k": "delta", "replica": "inst_other", "seq": 2, "gone": [],
                              "sessions": [messages.announcement(ours.session)]})
    view.apply("inst_other", {"k": "delta", "replica": "inst_other", "seq": 3, "sessions": [],
                              "gone": [theirs.session.id]})
    stand_in = registry.get(theirs.session.id)
    assert stand_in is not None and isinstance(stand_in.link, RemoteLink) and stand_in.link.holder == HOLDER
    assert not gone
    assert registry.get(ours.session.id) is ours.session
    assert dropped("impersonation") == before + 3  # the leaving for another, and two sessions it does not hold


def test_split_frames_are_bounded_per_sender_and_kept_apart() -> None:
    frames = messages.SplitFrames(max_buffered=2500)
    parts = [messages.read_hold(p) for p in
             messages.hold_parts("request", b"z" * 5000, messages.HEADER_ROOM + 1000, t="abc", s="p", r="r", f="b")]
    before = dropped("impersonation"), dropped("over_limit")
    assert frames.add("inst_b", *parts[0]) is None and frames.add("inst_c", *parts[1]) is None
    assert frames.add("inst_b", *parts[1]) is None and frames.add("inst_b", *parts[2]) is None
    assert not frames  # a third part would pass 2,500 bytes: the frame is given up
    assert (dropped("impersonation"), dropped("over_limit")) == (before[0] + 1, before[1] + 1)


def test_the_holder_passes_a_node_only_an_inference_request() -> None:
    holder = Holder(None, None, Subjects("t", "inst_a"))  # type: ignore[arg-type]
    before = dropped("not_a_request")
    header = {"k": "request", "t": "abc", "s": "prov_1", "r": "req_1", "f": "inst_b"}
    junk = b'{"type":"trust_status","trust_level":"hardware","certificate":"junk"}'
    holder._request(header, junk)  # never reaches the registry: refused as it parses
    holder._request(header, dump(Cancel(request_id="req_1")).encode())
    other = InferenceRequest(request_id="req_2", encrypted_body=Envelope(ephemeral_public_key="k", ciphertext="c"))
    holder._request(header, dump(other).encode())  # a request, but not the one the header names
    assert dropped("not_a_request") == before + 3 and not holder.hosted


async def test_placement_takes_a_session_held_here_when_it_ranks_as_well() -> None:
    view, registry, _ = view_of_b(nats_url="nats://127.0.0.1:4222")
    here = SimProvider(max_concurrency=2)
    registry.add(here.session)
    there = SimProvider(max_concurrency=2)
    announce(view, there)
    settings_ = view.services.settings
    public = RouteDecision(model=MODEL)
    assert {select(registry, public, settings_) for _ in range(50)} == {here.session}  # equal: never the hop
    here.set_active(1)  # busier here: the other replica's session is strictly better
    assert select(registry, public, settings_) is registry.get(there.session.id)
    here.set_active(0)
    assert {select_idle_or_free(registry, public, settings_, idle_only=True) for _ in range(50)} == {here.session}


async def test_placement_takes_a_session_held_here_that_is_as_good_though_a_little_busier() -> None:
    """A NATS hop costs both replicas CPU: a session held here is taken while it is at most a quarter
    of its capacity busier and four fifths as fast; past either, the other replica's."""
    view, registry, _ = view_of_b(nats_url="nats://127.0.0.1:4222")
    here = SimProvider(max_concurrency=8, decode_tps=85.0)
    registry.add(here.session)
    there = SimProvider(max_concurrency=8, decode_tps=100.0)
    announce(view, there)
    settings_ = view.services.settings
    public = RouteDecision(model=MODEL)
    here.set_active(2)  # 2/8 busier, 85 % of the speed: as good
    assert {select(registry, public, settings_) for _ in range(20)} == {here.session}
    here.set_active(3)  # 3/8 busier: the other replica's
    assert select(registry, public, settings_) is registry.get(there.session.id)
    here.set_active(0)
    announce(view, there, decode_tps=200.0)  # here is 40 % of its speed: the other replica's
    assert select(registry, public, settings_) is registry.get(there.session.id)


async def test_placement_weighs_a_faster_session_elsewhere_by_the_decoding_it_saves() -> None:
    """Slower here than four fifths of the speed there: the other replica's when that costs the answer
    (its max_tokens at the two speeds) more than LOCAL_DECODE_SLACK, else still the session here."""
    view, registry, _ = view_of_b(nats_url="nats://127.0.0.1:4222")
    here = SimProvider(max_concurrency=8, decode_tps=24_000.0)  # an instant upstream, measured over ~1 ms
    registry.add(here.session)
    there = SimProvider(max_concurrency=8, decode_tps=40_000.0)
    announce(view, there)
    settings_ = view.services.settings
    short = RouteDecision(model=MODEL, output_tokens=16)  # 0.7 ms against 0.4 ms: not worth the hop
    assert {select(registry, short, settings_) for _ in range(20)} == {here.session}
    long = RouteDecision(model=MODEL, output_tokens=4096)  # 171 ms against 102 ms
    assert select(registry, long, settings_) is registry.get(there.session.id)
    unknown = RouteDecision(model=MODEL)  # no bound to weigh: the speeds alone
    assert select(registry, unknown, settings_) is registry.get(there.session.id)
    here.session.report_speed(40.0)
    announce(view, there, decode_tps=100.0)  # a model's speeds: 16 tokens 400 ms against 160 ms
    assert select(registry, short, settings_) is registry.get(there.session.id)


def test_deltas_kept_while_a_view_comes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from darkbloom.coordinator.fabric import view as view_module
    monkeypatch.setattr(view_module, "MAX_WAITING", 3)
    view, _, _ = view_of_b()
    sims = [SimProvider() for _ in range(4)]
    for seq, sim in enumerate(sims, start=5):  # not in step (never had its view): each is kept
        view.apply(HOLDER, {"k": "delta", "replica": HOLDER, "seq": seq, "gone": [],
                            "sessions": [messages.announcement(sim.session)]})
    heard = view.heard[HOLDER]
    assert heard.seq is None and sorted(heard.waiting) == [8] and heard.waiting_items == 1  # 4 > 3: the first let go
