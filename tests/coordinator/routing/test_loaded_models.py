"""Loaded models shape placement: what a node has in memory (its registration's ``loaded_models``, then
every heartbeat's ``models``) ranks its session before one that would first have to load the model,
on first placement, retries and the backup; the load counts in the attempt's first-content budget;
an owner's own machine is never refused for not having the model loaded; and other replicas learn
the loaded set from the session's announcement."""

from __future__ import annotations

import asyncio

import pytest

from darkbloom.coordinator.fabric import messages
from darkbloom.coordinator.fleet.registry import Registry
from darkbloom.coordinator.inference.attempts import Attempts
from darkbloom.coordinator.routing import scheduler
from darkbloom.coordinator.routing.scheduler import load_seconds, select, select_idle_or_free, try_place
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.protocol import Heartbeat, ModelInfo, parse_provider_frame
from tests.coordinator.fabric.test_view import announce, view_of_b
from tests.coordinator.routing.sim import (MODEL, SimProvider, chat, decision, dispatched, end_as_gone, fleet,
                                          lifecycle, services, settings)

OWNER = "acct_owner"
REQUEST_ID = "chatcmpl-sim"
_nothing = ()


def test_the_loaded_set_comes_from_the_registration() -> None:
    assert SimProvider().session.loaded_models == {MODEL.id}  # an older node says nothing: all loaded
    assert SimProvider(loaded=()).session.loaded_models == frozenset()
    assert SimProvider(models=(MODEL.id, "other"), loaded=("other", "never-advertised")).session.loaded_models \
        == {"other"}


def test_a_heartbeat_reports_what_is_loaded_now() -> None:
    registry = Registry()
    provider, = fleet(registry, 1, models=(MODEL.id, "other"))
    session = provider.session
    session.heartbeat(parse_provider_frame('{"type": "heartbeat", "models": ["other"]}'))
    assert session.loaded_models == {"other"}
    session.heartbeat(parse_provider_frame('{"type": "heartbeat"}'))  # unchanged
    assert session.loaded_models == {"other"}
    session.heartbeat(Heartbeat(models=[]))
    assert session.loaded_models == frozenset()


def test_a_session_with_the_model_loaded_ranks_first() -> None:
    registry = Registry()
    cold, = fleet(registry, 1, max_concurrency=4, decode_tps=500.0, loaded=_nothing)  # idle, fast, not loaded
    warm, = fleet(registry, 1, max_concurrency=4, decode_tps=10.0, active=2)          # busier, slower, loaded
    assert select(registry, decision(), settings()) is warm.session
    warm.set_active(3)
    assert select(registry, decision(), settings()) is warm.session  # its last free slot still wins
    warm.set_active(4)
    assert select(registry, decision(), settings()) is cold.session  # full: the other loads it
    warm.set_active(2)
    warm.session.report_loaded([])  # the node unloaded it (keep-alive): both would load, the idle one wins
    assert select(registry, decision(), settings()) is cold.session
    cold.session.report_loaded(["smollm2"])  # an alias of the model counts
    assert select(registry, decision(), settings()) is cold.session
    cold.session.report_loaded([])
    warm.session.report_loaded([MODEL.id])
    assert select(registry, decision(), settings()) is warm.session


def test_retries_and_the_backup_prefer_a_loaded_session_too() -> None:
    registry = Registry()
    cold, = fleet(registry, 1, max_concurrency=2, decode_tps=500.0, loaded=_nothing)
    warm, = fleet(registry, 1, max_concurrency=2, active=1)
    assert select_idle_or_free(registry, decision(), settings(), idle_only=False) is warm.session
    assert select_idle_or_free(registry, decision(), settings(), idle_only=True) is cold.session


def test_owned_comes_before_loaded_and_is_never_refused_for_not_having_it() -> None:
    registry = Registry()
    mine, = fleet(registry, 1, account=OWNER, machine="mach_mine", loaded=_nothing)
    fleet(registry, 3, decode_tps=100.0)  # loaded, public
    exclusive = decision(owner_account_id=OWNER, owned_only=True)
    placement = try_place(registry, exclusive, settings())
    assert placement is not None and placement.session is mine.session  # the node loads it
    placement.slot.release()
    placement = try_place(registry, decision(owner_account_id=OWNER), settings())
    assert placement is not None and placement.session is mine.session  # prefer: own machine first


def test_the_load_estimate() -> None:
    names = decision().names
    assert load_seconds(SimProvider(size_bytes=4_000_000_000).session, decision()) == 0.0  # loaded
    cold = SimProvider(size_bytes=4_000_000_000, loaded=_nothing).session
    assert load_seconds(cold, decision()) == pytest.approx(scheduler.LOAD_SECONDS_BASE + 4.0)
    sized = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, size_bytes=2 * 10 ** 9)
    unsized = SimProvider(loaded=_nothing).session  # the node does not say: the catalog's size
    assert load_seconds(unsized, decision(model=sized)) == pytest.approx(scheduler.LOAD_SECONDS_BASE + 2.0)
    assert load_seconds(unsized, decision()) == scheduler.LOAD_SECONDS_BASE
    huge = SimProvider(size_bytes=10 ** 15, loaded=_nothing).session  # a node cannot stretch a deadline forever
    assert load_seconds(huge, decision()) == scheduler.MAX_LOAD_SECONDS
    assert cold.size_for(names) == 4_000_000_000


def test_the_load_estimate_of_a_size_too_large_for_a_float_is_the_cap() -> None:
    """A size past any float (the wire refuses it; a catalog may say it) is capped before it is divided."""
    absurd = SimProvider(loaded=_nothing).session
    [model] = absurd.registration.models
    absurd.registration.models[0] = ModelInfo.model_construct(**{**model.model_dump(), "size_bytes": 10 ** 400})
    assert load_seconds(absurd, decision()) == scheduler.MAX_LOAD_SECONDS
    catalog = CatalogModel(id=MODEL.id, aliases=MODEL.aliases, input_price=1, output_price=1, size_bytes=10 ** 400)
    assert load_seconds(SimProvider(loaded=_nothing).session, decision(model=catalog)) == scheduler.MAX_LOAD_SECONDS


BUDGET = 0.4


async def test_the_load_counts_in_the_first_content_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node loading the model gets its load before the budget starts: no timeout, no backup, while
    it loads (the other, idle session is not sent the request)."""
    monkeypatch.setattr(scheduler, "LOAD_SECONDS_BASE", 3 * BUDGET)
    registry = Registry()
    providers = fleet(registry, 2, loaded=_nothing)
    svc = services(registry, settings(first_content_timeout=BUDGET))
    route = decision()
    placement = try_place(registry, route, svc.settings)
    assert placement is not None
    attempts = Attempts(lifecycle(svc, REQUEST_ID), route, "chat", chat().node_body(64))
    run = asyncio.ensure_future(attempts.run(placement))
    primary = await dispatched(providers)
    other, = [p for p in providers if p is not primary]
    await asyncio.sleep(2 * BUDGET)  # past a loaded node's whole budget, within this one's load
    assert not run.done() and other.requests() == []
    await other.next_request(timeout=4 * BUDGET)  # the backup, half a budget after the load
    primary.reply(REQUEST_ID, "loaded at last")
    winner, _ = await asyncio.wait_for(run, 2)
    assert winner.session is primary.session and other.cancels() == [REQUEST_ID]
    await end_as_gone(attempts.life)


async def test_other_replicas_learn_the_loaded_set() -> None:
    view, registry, _ = view_of_b()
    sim = SimProvider(models=(MODEL.id, "other", "third"), loaded=("third",))
    announced = messages.announcement(sim.session)
    assert announced["loaded"] == [2]  # by position: never longer than the model list
    announce(view, sim)
    stand_in = registry.get(sim.session.id)
    assert stand_in is not None and stand_in.loaded_models == {"third"}
    sim.session.report_loaded([MODEL.id, "other"])
    announce(view, sim)
    assert stand_in.loaded_models == {MODEL.id, "other"}
    announce(view, sim, loaded=[0, 99, -1, "2", None])  # positions that point nowhere mean nothing
    assert stand_in.loaded_models == {MODEL.id}
    withheld = {k: v for k, v in messages.announcement(sim.session).items() if k != "loaded"}
    assert messages.loaded_of(withheld, stand_in.registration.models) == {MODEL.id, "other", "third"}


def test_a_stand_in_that_loads_the_model_moves_up_here() -> None:
    view, registry, _ = view_of_b()
    cold, warm = SimProvider(loaded=_nothing, decode_tps=100.0), SimProvider(max_concurrency=4)
    announce(view, cold, warm)
    assert select(registry, decision(), view.services.settings).id == warm.session.id
    cold.session.report_loaded([MODEL.id])
    warm.session.report_loaded([])
    announce(view, cold, warm)
    assert select(registry, decision(), view.services.settings).id == cold.session.id

