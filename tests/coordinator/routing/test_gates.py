"""The scheduler's gates, their fixed order, owner restriction and selection, over simulated sessions."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.gates import GATES, PRIVACY_GATES, first_failed_gate
from darkbloom.coordinator.routing.scheduler import candidates, choose, routable_public, survey, try_place
from tests.coordinator.routing.sim import BAD_HASH, GOOD_HASH, MODEL, SimProvider, decision, fleet, settings

OWNER = "acct_owner"
OTHER = "acct_other"
NOW = time.monotonic


def reason_of(provider: SimProvider, **decision_fields: Any) -> str | None:
    config = decision_fields.pop("config", None) or settings()
    return first_failed_gate(provider.session, decision(**decision_fields), config, NOW())


def test_the_order_is_fixed() -> None:
    assert [gate.name for gate in GATES] == [
        "model_not_served", "unverified_weights", "untrusted", "private_only", "trust_below_floor",
        "runtime_not_verified", "no_encrypted_chunks", "challenge_stale", "capability_unsupported",
        "context_length"]
    assert PRIVACY_GATES == {"runtime_not_verified", "no_encrypted_chunks", "challenge_stale"}


def test_a_healthy_session_passes_every_gate() -> None:
    assert reason_of(SimProvider()) is None


# one rejection per gate


def test_model_not_served() -> None:
    assert reason_of(SimProvider(models=("other-model",))) == "model_not_served"
    assert reason_of(SimProvider(models=("smollm2",))) is None  # a catalog alias serves the model


def test_weight_hash_pinned_by_the_catalog() -> None:
    pinned = CatalogModel(id=MODEL.id, input_price=1, output_price=1, weight_hash=GOOD_HASH)
    assert reason_of(SimProvider(weight_hash=BAD_HASH), model=pinned) == "unverified_weights"
    assert reason_of(SimProvider(weight_hash=""), model=pinned) == "unverified_weights"  # missing
    assert reason_of(SimProvider(weight_hash=GOOD_HASH), model=pinned) is None
    assert reason_of(SimProvider(weight_hash=BAD_HASH)) is None  # no pin, any weights


def test_other_weights_still_serve_their_owner() -> None:
    pinned = CatalogModel(id=MODEL.id, input_price=1, output_price=1, weight_hash=GOOD_HASH)
    mine = SimProvider(weight_hash=BAD_HASH, account=OWNER)
    assert reason_of(mine, model=pinned, owner_account_id=OWNER, owned_only=True) is None  # exclusive
    assert reason_of(mine, model=pinned, owner_account_id=OWNER) is None                   # prefer
    assert reason_of(mine, model=pinned) == "unverified_weights"                           # public
    assert reason_of(mine, model=pinned, owner_account_id=OTHER) == "unverified_weights"   # another's prefer


def test_the_pinned_weights_under_an_alias_count() -> None:
    pinned = CatalogModel(id=MODEL.id, aliases=["smollm2"], input_price=1, output_price=1, weight_hash=GOOD_HASH)
    assert reason_of(SimProvider(models=("smollm2",), weight_hash=GOOD_HASH), model=pinned) is None


def test_context_length() -> None:
    short = SimProvider(context_length=2048)
    assert reason_of(short, context_needed=2048) is None
    assert reason_of(short, context_needed=2049) == "context_length"
    assert reason_of(short) is None                                           # not checked
    assert reason_of(SimProvider(context_length=0), context_needed=10 ** 9) is None  # it does not say
    # never relaxed for the owner: its node could not take the request either
    assert reason_of(SimProvider(context_length=512, account=OWNER), context_needed=1000,
                     owner_account_id=OWNER, owned_only=True) == "context_length"


def test_untrusted_and_offline() -> None:
    assert reason_of(SimProvider(untrusted="bad signature")) == "untrusted"
    assert reason_of(SimProvider(online=False)) == "untrusted"
    draining = SimProvider()
    draining.session.start_draining()  # its machine was unlinked: finishing, taking nothing new
    assert reason_of(draining) == "untrusted"
    # never relaxed for the owner
    assert reason_of(SimProvider(untrusted="bad signature", account=OWNER), owner_account_id=OWNER,
                     owned_only=True) == "untrusted"


def test_private_only_is_for_its_owner_alone() -> None:
    private = SimProvider(private_only=True, account=OWNER)
    assert reason_of(private) == "private_only"
    assert reason_of(private, owner_account_id=OTHER) == "private_only"
    assert reason_of(private, owner_account_id=OWNER) is None                   # prefer
    assert reason_of(private, owner_account_id=OWNER, owned_only=True) is None  # exclusive


def test_trust_floor_relaxed_only_for_owned_sessions() -> None:
    assert reason_of(SimProvider(trust="none")) == "trust_below_floor"
    hardware_floor = settings(min_trust="hardware")
    assert reason_of(SimProvider(trust="self_signed"), config=hardware_floor) == "trust_below_floor"
    assert reason_of(SimProvider(trust="hardware"), config=hardware_floor) is None
    assert reason_of(SimProvider(trust="none"), config=settings(min_trust="none")) is None
    owned = SimProvider(trust="none", account=OWNER)
    assert reason_of(owned, owner_account_id=OWNER) is None
    assert reason_of(owned, owner_account_id=OTHER) == "trust_below_floor"
    assert reason_of(owned) == "trust_below_floor"


def test_runtime_not_verified() -> None:
    assert reason_of(SimProvider(runtime_verified=False)) == "runtime_not_verified"


def test_no_encrypted_chunks_or_no_key() -> None:
    assert reason_of(SimProvider(encrypted=False)) == "no_encrypted_chunks"
    assert reason_of(SimProvider(with_key=False)) == "no_encrypted_chunks"


def test_challenge_stale_or_never_passed() -> None:
    freshness = settings().challenge_freshness
    assert reason_of(SimProvider(challenge_age=None)) == "challenge_stale"
    assert reason_of(SimProvider(challenge_age=freshness + 5)) == "challenge_stale"
    assert reason_of(SimProvider(challenge_age=freshness - 5)) is None
    assert reason_of(SimProvider(challenge_age=60), config=settings(challenge_freshness=30)) == "challenge_stale"


@pytest.mark.parametrize("broken", [dict(runtime_verified=False), dict(encrypted=False), dict(with_key=False),
                                    dict(challenge_age=None)])
def test_privacy_gates_are_never_relaxed_for_the_owner(broken: dict[str, Any]) -> None:
    owned = SimProvider(account=OWNER, **broken)
    assert reason_of(owned, owner_account_id=OWNER, owned_only=True) in PRIVACY_GATES


def test_images_need_a_vision_model() -> None:
    assert reason_of(SimProvider(vision=False), needs=frozenset({"images"})) == "capability_unsupported"
    assert reason_of(SimProvider(vision=True), needs=frozenset({"images"})) is None
    assert reason_of(SimProvider(vision=False)) is None


@pytest.mark.parametrize("needs, advertised, served", [
    ({"tools"}, (), False),
    ({"tools"}, ("tools",), True),
    ({"tools", "structured_output"}, ("tools",), False),
    ({"tools", "structured_output"}, ("structured_output", "tools", "logprobs"), True),
    ({"embeddings"}, ("completions",), False),
    ({"completions"}, ("completions", "embeddings"), True),
    ({"images"}, ("images",), True),  # a capability may also say what is_vision says
    (set(), ("no-such-capability",), True),
])
def test_a_request_goes_only_where_every_capability_it_needs_is_advertised(
        needs: set[str], advertised: tuple[str, ...], served: bool) -> None:
    reason = reason_of(SimProvider(capabilities=advertised), needs=frozenset(needs))
    assert reason == (None if served else "capability_unsupported")


def test_an_unknown_capability_advertised_grants_nothing() -> None:
    assert reason_of(SimProvider(capabilities=("teleportation",)), needs=frozenset({"teleportation"})) \
        == "capability_unsupported"


def test_no_free_slot_is_counted_after_the_gates() -> None:
    registry = Registry()
    busy, = fleet(registry, 1, max_concurrency=2, active=2)
    found = survey(registry, decision(), settings())
    assert found.eligible == [busy.session] and found.available == []
    assert found.reasons == {"no_free_slot": 1}
    assert try_place(registry, decision(), settings()) is None
    busy.set_active(1)
    assert survey(registry, decision(), settings()).available == [busy.session]


# the order: a session failing two gates reports the first

_BREAKERS: dict[str, dict[str, Any]] = {
    "model_not_served": dict(models=("other-model",)),
    "unverified_weights": dict(weight_hash=BAD_HASH),
    "untrusted": dict(untrusted="failed a challenge"),
    "private_only": dict(private_only=True),
    "trust_below_floor": dict(trust="none"),
    "runtime_not_verified": dict(runtime_verified=False),
    "no_encrypted_chunks": dict(encrypted=False),
    "challenge_stale": dict(challenge_age=None),
    "capability_unsupported": dict(vision=False),
    "context_length": dict(context_length=100),
}
_PINNED = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, weight_hash=GOOD_HASH)
# a request every breaker turns away: images, a pinned model, more context than 100 tokens
_DEMANDING = dict(needs=frozenset({"images"}), model=_PINNED, context_needed=1000)
_HEALTHY = dict(vision=True, weight_hash=GOOD_HASH, context_length=4096)


@pytest.mark.parametrize("first,second", list(itertools.combinations([gate.name for gate in GATES], 2)))
def test_a_session_failing_two_gates_reports_the_earlier(first: str, second: str) -> None:
    fields: dict[str, Any] = {**_HEALTHY, **_BREAKERS[second], **_BREAKERS[first]}
    assert reason_of(SimProvider(**fields), **_DEMANDING) == first


def test_every_gate_has_a_breaker() -> None:
    assert set(_BREAKERS) == {gate.name for gate in GATES}
    assert reason_of(SimProvider(**_HEALTHY), **_DEMANDING) is None
    for name, fields in _BREAKERS.items():
        assert reason_of(SimProvider(**{**_HEALTHY, **fields}), **_DEMANDING) == name


# survey: reasons and metrics


def _rejections(reason: str) -> float:
    return REGISTRY.get_sample_value("darkbloom_scheduler_rejections_total", {"reason": reason}) or 0.0


def test_survey_counts_reasons_and_metrics() -> None:
    registry = Registry()
    fleet(registry, 2, untrusted="bad chunk")
    fleet(registry, 1, runtime_verified=False)
    fleet(registry, 1, active=1)
    good, = fleet(registry, 1)
    before = {reason: _rejections(reason) for reason in ("untrusted", "runtime_not_verified", "no_free_slot")}
    found = survey(registry, decision(), settings())
    assert found.reasons == {"untrusted": 2, "runtime_not_verified": 1, "no_free_slot": 1}
    assert found.available == [good.session] and len(found.eligible) == 2
    for reason, count in found.reasons.items():
        assert _rejections(reason) == before[reason] + count


def test_excluded_sessions_are_skipped() -> None:
    registry = Registry()
    a, b = fleet(registry, 2)
    found = survey(registry, decision(excluded={a.id}), settings())
    assert found.eligible == [b.session] and found.reasons == {}


# public requests never see private_only sessions


def test_private_only_never_in_public_results() -> None:
    registry = Registry()
    private, = fleet(registry, 1, private_only=True, account=OWNER)
    public_decision = decision()
    found = survey(registry, public_decision, settings())
    assert found.eligible == [] and found.reasons == {"private_only": 1}
    assert try_place(registry, public_decision, settings()) is None
    assert not routable_public(registry, MODEL, settings())
    # its owner does see it
    placement = try_place(registry, decision(owner_account_id=OWNER), settings())
    assert placement is not None and placement.session is private.session
    placement.slot.release()
    assert try_place(registry, decision(owner_account_id=OWNER, owned_only=True), settings()).session \
        is private.session


def test_routable_public_ignores_load_but_not_gates() -> None:
    registry = Registry()
    assert not routable_public(registry, MODEL, settings())
    busy, = fleet(registry, 1, active=1)
    assert routable_public(registry, MODEL, settings())
    busy.session.distrust("changed runtime")
    assert not routable_public(registry, MODEL, settings())
    fleet(registry, 1, trust="self_signed")
    assert not routable_public(registry, MODEL, settings(min_trust="hardware"))


# owner restriction


def _owner_world() -> tuple[Registry, list[SimProvider], list[SimProvider], list[SimProvider]]:
    registry = Registry()
    owned = fleet(registry, 2, account=OWNER, machine="mach_owner")
    public = fleet(registry, 5, decode_tps=500.0)  # faster than anything owned
    others = fleet(registry, 2, account=OTHER)
    return registry, owned, public, others


def test_owner_restricted_candidates_are_only_the_owners_sessions() -> None:
    registry, owned, public, others = _owner_world()
    exclusive = decision(owner_account_id=OWNER, owned_only=True)
    assert set(candidates(registry, exclusive)) == {p.session for p in owned}
    found = survey(registry, exclusive, settings())
    assert set(found.eligible) == {p.session for p in owned}
    for p in owned:
        p.set_active(1)
    assert try_place(registry, exclusive, settings()) is None  # busy owned, idle public: never the fleet
    assert all(p.session.active == 0 for p in public + others)


def test_exclusive_with_an_offline_or_unrelated_model_session() -> None:
    registry = Registry()
    fleet(registry, 1, account=OWNER, models=("llama-3",))
    found = survey(registry, decision(owner_account_id=OWNER, owned_only=True), settings())
    assert found.eligible == [] and found.reasons == {"model_not_served": 1}


def test_prefer_uses_an_owned_session_even_when_public_is_faster() -> None:
    registry, owned, public, _ = _owner_world()
    prefer = decision(owner_account_id=OWNER)
    placement = try_place(registry, prefer, settings())
    assert placement is not None and placement.owned and placement.session in {p.session for p in owned}
    placement = try_place(registry, prefer, settings())
    assert placement is not None and placement.owned
    # both owned sessions busy now: the fleet
    placement = try_place(registry, prefer, settings())
    assert placement is not None and not placement.owned and placement.session in {p.session for p in public}


def test_pinned_machine_or_session() -> None:
    registry = Registry()
    first, second = fleet(registry, 1, account=OWNER, machine="mach_a") + fleet(registry, 1, account=OWNER,
                                                                               machine="mach_b")
    by_machine = decision(owner_account_id=OWNER, owned_only=True, pinned="mach_b")
    assert [s.id for s in candidates(registry, by_machine)] == [second.id]
    by_session = decision(owner_account_id=OWNER, owned_only=True, pinned=first.id)
    placement = try_place(registry, by_session, settings())
    assert placement is not None and placement.session is first.session
    assert try_place(registry, by_session, settings()) is None  # its one slot is taken; never the other


def test_another_accounts_pin_finds_nothing() -> None:
    registry = Registry()
    fleet(registry, 1, account=OTHER, machine="mach_other")
    assert list(candidates(registry, decision(owner_account_id=OWNER, owned_only=True, pinned="mach_other"))) == []


# selection


def test_selection_prefers_the_lower_expected_wait() -> None:
    registry = Registry()
    loaded, idle = fleet(registry, 2, max_concurrency=2)
    loaded.set_active(1)
    assert choose(survey(registry, decision(), settings()).available, decision()) is idle.session
    slow, fast = SimProvider(decode_tps=10.0), SimProvider(decode_tps=100.0)
    assert choose([slow.session, fast.session], decision()) is fast.session
    small, big = SimProvider(max_concurrency=1), SimProvider(max_concurrency=8)
    assert choose([small.session, big.session], decision()) is big.session


def test_ties_are_broken_at_random() -> None:
    random.seed(1234)
    a, b = SimProvider(), SimProvider()
    picks = {choose([a.session, b.session], decision()).id for _ in range(200)}
    assert picks == {a.id, b.id}


def test_owned_first_whatever_the_load() -> None:
    owned = SimProvider(account=OWNER, max_concurrency=4, active=3, decode_tps=1.0)
    public = SimProvider(decode_tps=1000.0)
    assert choose([public.session, owned.session], decision(owner_account_id=OWNER)) is owned.session
    assert choose([public.session], decision(owner_account_id=OWNER)) is public.session
    assert choose([public.session], decision(owner_account_id=OWNER, owned_only=True)) is None


def test_try_place_claims_the_slot_under_the_advertised_name() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, models=("smollm2",), max_concurrency=2)
    placement = try_place(registry, decision(), settings())
    assert placement is not None and placement.provider_model_id == "smollm2" and not placement.owned
    assert provider.session.active == 1


def test_each_route_builds_on_the_same_registry_indexes() -> None:
    """Sessions that leave the registry leave every candidate set."""
    registry = Registry()
    owned, = fleet(registry, 1, account=OWNER)
    public, = fleet(registry, 1)
    registry.remove(owned.session)
    registry.remove(public.session)
    assert list(candidates(registry, decision(owner_account_id=OWNER, owned_only=True))) == []
    assert list(candidates(registry, decision(owner_account_id=OWNER))) == []
    assert list(candidates(registry, decision())) == []


