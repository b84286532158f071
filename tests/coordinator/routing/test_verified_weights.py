"""Verified weights: for a catalog model with a ``weight_hash``, a session serving other weights (or not
saying which) gets no public request and counts in no public capacity or model list, yet serves its
owner (exclusive and prefer); a catalog change reaches every view; other replicas' stand-ins carry
the hashes; and the machine lists such models as ``unverified_models``."""

from __future__ import annotations

from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.routing.scheduler import (any_eligible, longest_context, routable_public, select,
                                                     try_place)
from darkbloom.wire.catalog import Catalog, CatalogModel
from tests.coordinator.fabric.test_view import announce, view_of_b
from tests.coordinator.routing.sim import BAD_HASH, GOOD_HASH, MODEL, SimProvider, decision, fleet, settings

OWNER = "acct_owner"
PINNED = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, weight_hash=GOOD_HASH)


def test_other_weights_never_serve_the_public_but_serve_their_owner() -> None:
    registry = Registry()
    mine, = fleet(registry, 1, weight_hash=BAD_HASH, account=OWNER, machine="mach_mine", context_length=8192)
    public = decision(model=PINNED)
    assert select(registry, public, settings()) is None
    assert not any_eligible(registry, public, settings())  # no public capacity: never queued for
    assert not routable_public(registry, PINNED, settings())  # nor listed in /v1/models
    assert longest_context(registry, public, settings()) == 0  # nor counted for the context check
    for route in (decision(model=PINNED, owner_account_id=OWNER, owned_only=True),
                  decision(model=PINNED, owner_account_id=OWNER)):
        placement = try_place(registry, route, settings())
        assert placement is not None and placement.session is mine.session and placement.owned
        placement.slot.release()
    assert select(registry, decision(model=PINNED, owner_account_id="acct_other"), settings()) is None


def test_a_prefer_request_falls_back_to_verified_weights_only() -> None:
    registry = Registry()
    mine, = fleet(registry, 1, weight_hash=BAD_HASH, account=OWNER)
    fleet(registry, 1, weight_hash=BAD_HASH)  # someone else's other weights
    good, = fleet(registry, 1, weight_hash=GOOD_HASH)
    mine.set_active(1)  # busy
    placement = try_place(registry, decision(model=PINNED, owner_account_id=OWNER), settings())
    assert placement is not None and placement.session is good.session and not placement.owned


def test_the_slot_is_claimed_under_the_name_with_the_pinned_weights() -> None:
    registry = Registry()
    provider = SimProvider(models=(MODEL.id, "smollm2"))
    registration = provider.session.registration
    registration.models[0].weight_hash, registration.models[1].weight_hash = BAD_HASH, GOOD_HASH
    registry.add(provider.session)
    placement = try_place(registry, decision(model=PINNED), settings())
    assert placement is not None and placement.provider_model_id == "smollm2"


def test_a_catalog_change_reaches_sessions_already_connected() -> None:
    registry = Registry()
    other, = fleet(registry, 1, weight_hash=BAD_HASH)
    unpinned = decision()
    assert select(registry, unpinned, settings()) is other.session  # opens the unpinned views
    registry.close_views()  # what storing a catalog does
    assert registry._views == {}
    assert select(registry, decision(model=PINNED), settings()) is None  # the pin applies at once
    assert select(registry, unpinned, settings()) is other.session  # and lifting it again


def test_stand_ins_carry_the_hashes() -> None:
    view, registry, _ = view_of_b()
    theirs = SimProvider(weight_hash=BAD_HASH, account=OWNER, machine="mach_theirs")
    announce(view, theirs)
    stand_in = registry.get(theirs.session.id)
    assert stand_in is not None
    assert select(registry, decision(model=PINNED), view.services.settings) is None
    assert select(registry, decision(model=PINNED, owner_account_id=OWNER, owned_only=True),
                  view.services.settings) is stand_in
    catalog = Catalog(models=[PINNED])
    assert catalog.unverified((m.id, m.weight_hash) for m in stand_in.registration.models) == [MODEL.id]


def test_unverified_models_of_a_machine() -> None:
    catalog = Catalog(models=[PINNED, CatalogModel(id="free-for-all", input_price=1, output_price=1)])
    advertised = [(MODEL.id, BAD_HASH), ("smollm2", GOOD_HASH), ("free-for-all", BAD_HASH), ("mine-only", ""),
                  (MODEL.id, "")]
    assert catalog.unverified(advertised) == [MODEL.id]
    assert catalog.unverified([("smollm2", "")]) == ["smollm2"]  # missing is not the pinned hash
    assert catalog.unverified([]) == []
