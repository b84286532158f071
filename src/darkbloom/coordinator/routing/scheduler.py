"""Choosing a provider session: named gates in a fixed order, then the lowest expected wait (the
model already loaded first: a load costs seconds, ``load_seconds``).

A ``RouteDecision`` is made once per request and carried through first dispatch, sequential
retries, the speculative backup and the queue, so all four honour the same rules (which
sessions may be used, what is relaxed for the owner, which sessions already failed).

Selection does not scan the fleet: ``select`` walks the registry's views (the request's owned view,
then the model's public one) in expected-wait order and puts only the sessions it reaches through
the gates, taking the first rank with a session that passes them (at random within the rank). When
that finds nothing, ``blocked_by_capability`` asks the views without the request's capabilities; the
full ``survey`` — every candidate through every gate, with the reasons — runs only for the Self-Route
pre-flight, over the owner's sessions. The rejection counter therefore counts the sessions a selection
examined and turned away, plus every rejection of a full survey.

A request's first selection from its model's public view is counted for machine insight by the view's
tally (fleet/insight.py): the sessions it turned away, by gate, and the one it chose; the tally works
out from those what each machine that advertised the model was passed over for.

With replicas (``--nats-url``), a session this replica holds is taken over another replica's when it
is as good (``as_good_here``): its request then makes no NATS hop, which costs both replicas CPU and
the request a round trip. Another replica's session is taken only when it is clearly better: it has
the model loaded and the one here does not, or the one here is busier by more than LOCAL_LOAD_SLACK
of its capacity, or slower than LOCAL_SPEED_SHARE of its speed where that costs the request's answer
(its ``max_tokens`` at the two measured speeds) more than LOCAL_DECODE_SLACK of decoding. Speeds
that far apart in ratio but not in time are those of very fast sessions, measured over a few
milliseconds each: their difference is mostly noise, and less than the hop costs.

A first placement (``try_place``, and the queue's) prefers the session that served the request's
conversation before (``decision.affinity``, routing/affinity.py) over the one a view's order came to,
when it is in that same view, has a free slot, passes every gate and still has the model loaded (an
unloaded model took its cache with it); that choice also outweighs a session held on this replica.
Retries and the backup never look at it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from prometheus_client import Counter

from darkbloom.wire.catalog import CatalogModel
from darkbloom.coordinator.config import CoordinatorSettings
from darkbloom.coordinator.fleet.registry import Registry, SessionView
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import FreeOrder, Slot, Ties, speed_of
from darkbloom.coordinator.routing.decision import RouteDecision
from darkbloom.coordinator.fleet.insight import ViewTally
from darkbloom.coordinator.routing.gates import (NO_FREE_SLOT, first_failed_gate, first_failed_lasting_gate,
                                                 passes_lasting_gates)

log = logging.getLogger("darkbloom.scheduler")
REJECTIONS = Counter("darkbloom_scheduler_rejections_total", "Sessions a gate turned away", ["reason"])


@dataclass(frozen=True)
class Claim:
    """A claimed slot on a session that can serve the request, and the model id it knows it by."""

    slot: Slot
    provider_model_id: str
    owned: bool

    @property
    def session(self) -> ProviderSession:
        return self.slot.session


@dataclass
class Survey:
    """What the gates found: who could serve at all, who can serve now, and why others cannot."""

    eligible: list[ProviderSession] = field(default_factory=list)
    available: list[ProviderSession] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


Order = Callable[[FreeOrder], Iterator[Ties]]
Rank = Callable[[ProviderSession], tuple[bool, float, float]]  # what ``Order`` sorts by: lower is better
_PROBES = 8  # random draws within a rank before it is walked whole
LOCAL_LOAD_SLACK = 0.25
LOCAL_SPEED_SHARE = 0.8
LOCAL_DECODE_SLACK = 0.01  # seconds of decoding a session elsewhere must save to be worth the hop
# What loading a model the node does not have in memory costs before its first token: reading the
# GGUF at about 1 GB/s (an SSD read, page-in and, on a Mac, the Metal buffers; a fast NVMe does
# better, a SATA disk worse) plus a constant for the context, the KV cache and the first prefill.
# Capped, so that a node cannot stretch a request's deadline by advertising a huge file.
LOAD_SECONDS_BASE = 2.0
LOAD_BYTES_PER_SECOND = 1e9
MAX_LOAD_SECONDS = 120.0


def candidates(registry: Registry, decision: RouteDecision) -> Iterable[ProviderSession]:
    """Owner-restricted requests look only at the owner's sessions: O(their machines), not O(fleet)."""
    if decision.owned_only and decision.owner_account_id:
        pool: Iterable[ProviderSession] = registry.owned_by(decision.owner_account_id)
        if decision.shares:  # and the machines shared with the caller: O(those owners' machines)
            pool = set(pool) | {s for owner in decision.share_owners for s in registry.owned_by(owner)
                                if decision.granted(s) is not None}
    else:
        pool = registry.serving(decision.names)
        if decision.owner_account_id:
            pool = set(pool) | registry.owned_by(decision.owner_account_id)
    if decision.pinned:
        pool = [s for s in pool if decision.pinned in (s.id, s.machine_id)]
    return pool


def survey(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
           now: float | None = None) -> Survey:
    now = time.monotonic() if now is None else now
    result = Survey()
    for session in candidates(registry, decision):
        if session.id in decision.excluded:
            continue
        reason = first_failed_gate(session, decision, settings, now)
        if reason is None:
            result.eligible.append(session)
            if session.has_free_slot:
                result.available.append(session)
            else:
                reason = NO_FREE_SLOT
        if reason is not None:
            result.reasons[reason] = result.reasons.get(reason, 0) + 1
            REJECTIONS.labels(reason).inc()
            log.debug("session %s rejected for %s: %s", session.id, decision.model.id, reason)
    return result


def expected_wait(session: ProviderSession, names: tuple[str, ...]) -> tuple[bool, float, float]:
    """Rank for time to first content: the model (``names``) loaded before a session that would
    first have to load it, then load over capacity, then the faster measured decode speed (a session
    not yet measured ranks as the slowest among equally loaded ones)."""
    return not session.has_loaded(names), (session.active + 1) / session.max_concurrency, -session.decode_tps


def retry_rank(session: ProviderSession, names: tuple[str, ...]) -> tuple[bool, float, float]:
    """Rank for a retry or the backup: the model loaded first, then the fewest active, then the fastest."""
    return not session.has_loaded(names), session.active, -speed_of(session)


def load_seconds(session: ProviderSession, decision: RouteDecision) -> float:
    """What the session needs before its first token to load the model (0 when it has it loaded):
    from the size of its weights (else the catalog's), at ``LOAD_BYTES_PER_SECOND``. The size is
    capped before it is divided: no size a node reports can make it raise."""
    if session.has_loaded(decision.names):
        return 0.0
    size = min(session.size_for(decision.names) or decision.model.size_bytes or 0,
               MAX_LOAD_SECONDS * LOAD_BYTES_PER_SECOND)
    return min(MAX_LOAD_SECONDS, LOAD_SECONDS_BASE + size / LOAD_BYTES_PER_SECOND)


def choose(available: list[ProviderSession], decision: RouteDecision) -> Optional[ProviderSession]:
    """Owned sessions first whenever one is available (prefer and exclusive), then shared ones
    (shared routing), then the rest."""
    owned = [s for s in available if decision.owns(s)]
    shared = [s for s in available if not decision.owns(s) and decision.may_use(s)]
    pool = owned or shared or ([] if decision.owned_only else [s for s in available if not decision.owns(s)])
    if not pool:
        return None
    best = min(expected_wait(s, decision.names) for s in pool)
    return random.choice([s for s in pool if expected_wait(s, decision.names) == best])


def claim(registry: Registry, session: ProviderSession, decision: RouteDecision) -> Claim:
    """The slot, under the first of the model's names the session advertises (with a pin, the first
    with the pinned weights, when it has one)."""
    names = [name for name in decision.names if name in session.advertised_models]
    verified = {m.id for m in session.registration.models if decision.model.verifies(m.weight_hash)}
    provider_model_id = next((name for name in names if name in verified), names[0])
    return Claim(registry.slots.claim(session), provider_model_id, owned=decision.owns(session))


def try_place(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
              found: Survey | None = None) -> Claim | None:
    """Select (the conversation's session preferred) and claim; from ``found`` (a survey already made)
    when given."""
    session = (choose(found.available, decision) if found is not None
               else select(registry, decision, settings, affine=True))
    return claim(registry, session, decision) if session is not None else None


def select(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
           order: Order = FreeOrder.by_expected_wait, rank: Rank | None = None,
           affine: bool = False) -> Optional[ProviderSession]:
    """What ``choose`` would pick from a full survey: owned sessions first (prefer and exclusive),
    then those of each share (shared routing), the model's public sessions after (never for
    ``owned_only``), each view in ``order`` (by ``rank``, default ``expected_wait``); ``affine``:
    the conversation's session preferred within its view."""
    now = time.monotonic()
    owner = decision.owner_account_id
    rank = rank or (lambda session: expected_wait(session, decision.names))
    preferred = registry.get(decision.affinity) if affine and decision.affinity else None
    if owner is not None:
        found = _pick(registry, decision, settings, order, rank, owner, False, now, preferred=preferred)
        for sharer in decision.share_owners:
            if found is not None:
                break
            found = _pick(registry, decision, settings, order, rank, sharer, False, now, preferred=preferred)
        if found is not None or decision.owned_only:
            return found
    elif decision.owned_only:
        return None
    counting = not decision.tallied
    decision.tallied = True
    return _pick(registry, decision, settings, order, rank, None, owner is not None, now, counting, preferred)


def select_idle_or_free(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
                        idle_only: bool) -> Optional[ProviderSession]:
    """For a retry or the backup: owned first, then the model loaded, then the fewest active
    requests, then the fastest."""
    return select(registry, decision, settings, lambda free: free.by_active(idle_only),
                  lambda session: retry_rank(session, decision.names))


def _pick(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings, order: Order, rank: Rank,
          owner: str | None, skip_owned: bool, now: float, counting: bool = False,
          preferred: ProviderSession | None = None) -> Optional[ProviderSession]:
    """The first usable session of the view in ``order``, or the ``preferred`` one over it (``_affine``);
    with replicas, one held here when it ranks as well as another replica's that came first or is as
    good (``as_good_here``). ``counting``: the request's first public selection, told to the view's tally."""
    view = _view(registry, decision, settings, owner)
    tally = view.tally if counting else None
    if tally is not None:
        tally.request()
    found = _first(order(view.free), decision, settings, now, skip_owned, tally)
    if found is not None and preferred is not None and _affine(preferred, found, view, decision, settings, now,
                                                               skip_owned):
        found = preferred
    elif found is not None and settings.nats_url is not None and registry.held(found.id) is None:
        here = _first(order(_view(registry, decision, settings, owner, held_here=True).free), decision, settings,
                      now, skip_owned)
        if here is not None and (rank(here) <= rank(found) or as_good_here(here, found, decision)):
            found = here
    if found is not None and tally is not None:
        tally.chosen(found)
    return found


def _affine(preferred: ProviderSession, found: ProviderSession, view: SessionView, decision: RouteDecision,
            settings: CoordinatorSettings, now: float, skip_owned: bool) -> bool:
    """Whether the conversation's session takes the request instead of ``found``: a member of the same
    view with a free slot, through every gate, and with the model (and so its cache) still loaded."""
    return (preferred is not found and preferred in view.free and preferred.has_free_slot
            and preferred.has_loaded(decision.names)
            and _usable(preferred, decision, settings, now, skip_owned, count=False))


def as_good_here(here: ProviderSession, there: ProviderSession, decision: RouteDecision) -> bool:
    """Whether a session this replica holds serves about as well as another replica's: the model
    loaded if that one has it, its share of capacity in use at most LOCAL_LOAD_SLACK higher, and
    at least LOCAL_SPEED_SHARE of its measured speed — or, when slower than that, slower by at most
    LOCAL_DECODE_SLACK over the request's ``output_tokens``."""
    if there.has_loaded(decision.names) and not here.has_loaded(decision.names):
        return False
    if here.active / here.max_concurrency > there.active / there.max_concurrency + LOCAL_LOAD_SLACK:
        return False
    speed_here, speed_there = speed_of(here), speed_of(there)
    if speed_here >= LOCAL_SPEED_SHARE * speed_there:
        return True
    tokens = decision.output_tokens
    return speed_here > 0 and tokens > 0 and tokens / speed_here - tokens / speed_there <= LOCAL_DECODE_SLACK


def any_eligible(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings) -> bool:
    """Whether a survey would find an eligible session (busy or not), stopping at the first; one
    that has no free slot is counted as ``no_free_slot``."""
    found = _first_eligible(registry, decision, settings)
    if found is not None and not found.has_free_slot:
        REJECTIONS.labels(NO_FREE_SLOT).inc()
    return found is not None


def blocked_by_capability(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings) -> bool:
    """Whether a session would serve the request but for the capabilities it needs: what a survey
    counts as ``capability_unsupported`` (the last gate), asked of the views without the needs."""
    if not decision.needs:
        return False
    return _first_eligible(registry, dataclasses.replace(decision, needs=frozenset()), settings) is not None


def longest_context(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings) -> float:
    """The longest context among the sessions the decision may use for its model (its views: every
    lasting gate passed): infinite when one of them does not say, 0 when there are none. Kept by the
    views; with a pin, read from the pinned machine's sessions alone."""
    views = [_view(registry, decision, settings, owner) for owner in _owners(decision)]
    if not decision.owned_only:
        views.append(_view(registry, decision, settings, None))
    if decision.pinned:
        return max((_context_of(s, decision.names) for view in views for s in view
                    if decision.pinned in (s.id, s.machine_id)), default=0)
    return max((view.longest_context for view in views), default=0)


def _owners(decision: RouteDecision) -> tuple[str, ...]:
    """The accounts whose own views a decision reads before the public one: the caller's, then the
    owners of the machines shared with them."""
    owner = decision.owner_account_id
    return () if owner is None else (owner, *decision.share_owners)


def _context_of(session: ProviderSession, names: tuple[str, ...]) -> float:
    return session.context_for(names) or math.inf


def routable_public(registry: Registry, model: CatalogModel, settings: CoordinatorSettings) -> bool:
    """Whether at least one public session could serve the model (for /v1/models)."""
    return _first_eligible(registry, RouteDecision(model=model), settings) is not None


def _first_eligible(registry: Registry, decision: RouteDecision,
                    settings: CoordinatorSettings) -> Optional[ProviderSession]:
    now = time.monotonic()
    owner = decision.owner_account_id
    views = [(_view(registry, decision, settings, account), False) for account in _owners(decision)]
    if not decision.owned_only or owner is None:  # (owned_only without an owner: the survey's candidates)
        views.append((_view(registry, decision, settings, None), owner is not None))
    for view, skip_owned in views:
        for session in view:
            if _usable(session, decision, settings, now, skip_owned, count=False, taking=False):
                return session
    return None


def _view(registry: Registry, decision: RouteDecision, settings: CoordinatorSettings,
          owner: str | None, held_here: bool = False) -> SessionView:
    """The sessions of the decision's model (the owner's, or the public's) that pass the lasting gates
    (only those this replica holds, when ``held_here``)."""
    model = decision.model
    key = (decision.names, model.weight_hash, decision.needs, owner, settings.min_trust, held_here)
    view = registry.view(key)
    if view is None:
        shape = RouteDecision(model=model, needs=decision.needs, owner_account_id=owner)
        view = registry.open_view(key, decision.names, owner,
                                  lambda session: (passes_lasting_gates(session, shape, settings)
                                                   and (not held_here or registry.held(session.id) is not None)))
        if owner is None and not held_here:
            view.count_passed_over(registry.passed_over,
                                   lambda session: first_failed_lasting_gate(session, shape, settings))
    return view


def _usable(session: ProviderSession, decision: RouteDecision, settings: CoordinatorSettings, now: float,
            skip_owned: bool, count: bool = True, tally: ViewTally | None = None, taking: bool = True) -> bool:
    """Whether the request may use the session (``taking``: take one of its slots now)."""
    if session.id in decision.excluded or (skip_owned and decision.owns(session)):
        return False  # excluded, or owned and already looked at in the owned view
    if decision.shares and not decision.may_use(session):
        return False  # a sharer's machine that none of the caller's shares covers
    if decision.pinned and decision.pinned not in (session.id, session.machine_id):
        return False
    if taking and decision.batch and not batch_may_take(session, settings):
        return False  # its last free slots are kept for live requests
    reason = first_failed_gate(session, decision, settings, now)
    if reason is not None and count:
        REJECTIONS.labels(reason).inc()
        log.debug("session %s rejected for %s: %s", session.id, decision.model.id, reason)
        if tally is not None:
            tally.turned_away(session, reason)
    return reason is None


def batch_may_take(session: ProviderSession, settings: CoordinatorSettings) -> bool:
    """Whether a batch line may take one of the session's slots: it leaves ``batch_free_slots`` free for
    live requests (a session with no more slots than that runs batch lines one at a time)."""
    keep = min(settings.batch_free_slots, session.max_concurrency - 1)
    return session.active + 1 + keep <= session.max_concurrency


def _first(ranks: Iterator[Ties], decision: RouteDecision, settings: CoordinatorSettings, now: float,
           skip_owned: bool, tally: ViewTally | None = None) -> Optional[ProviderSession]:
    """The first rank holding a usable session, and a uniformly random usable one of that rank:
    random draws first, then (only if those all fail) the whole rank in random order."""
    for rank in ranks:
        size = sum(len(members) for members in rank)
        turned_away: set[ProviderSession] = set()
        if size > _PROBES:
            for _ in range(_PROBES):
                session = _nth(rank, random.randrange(size))
                if session not in turned_away:
                    if _usable(session, decision, settings, now, skip_owned, tally=tally):
                        return session
                    turned_away.add(session)
        everyone = [session for members in rank for session in members if session not in turned_away]
        random.shuffle(everyone)
        for session in everyone:
            if _usable(session, decision, settings, now, skip_owned, tally=tally):
                return session
    return None


def _nth(rank: Ties, index: int) -> ProviderSession:
    for members in rank:
        if index < len(members):
            return members[index]
        index -= len(members)
    raise IndexError(index)
