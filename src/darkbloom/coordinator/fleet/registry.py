"""Live provider sessions, indexed by model, by owner account and by machine; their slots; and the
views the scheduler selects from without scanning the fleet.

A ``SessionView`` is the set of sessions one kind of request may use — a model (its names), an
owner or the public, and an ``admits`` check the scheduler supplies (the gates that do not change
with the clock) — with the free sessions in a ``FreeOrder`` and the busy ones aside, and the context
lengths its members serve the model with (so the longest is known without a pass over them). The
registry opens a view on first use (one pass over the model's or the owner's sessions) and from then
on keeps it exact: sessions join and leave as they are added, removed and disowned, and as they
report a change through their methods (``fleet/session.py``): ``reorder`` for their active count,
decode speed or loaded models, ``refile`` for online, draining, trust or challenge, ``disowned`` for
their owner. A view of an account goes when the account's last session
does; every view goes when the catalog changes (``close_views``), to be opened again on first use.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections import Counter, defaultdict
from typing import Callable, Hashable, Iterable, Iterator

from darkbloom.coordinator.fleet.insight import PassedOver, ViewTally
from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import FreeOrder, Slots

log = logging.getLogger("darkbloom.registry")
GOING_AWAY = 1001  # the close code of an evicted session's socket


class SessionView:
    def __init__(self, key: Hashable, names: tuple[str, ...], account_id: str | None,
                 admits: Callable[[ProviderSession], bool]) -> None:
        self.key = key
        self.names = names
        self.account_id = account_id  # None: the public view of the model
        self.admits = admits
        self.free = FreeOrder()
        self.busy: set[ProviderSession] = set()
        self._contexts: Counter[int] = Counter()  # the members' context lengths for the model (0: unknown)
        self.tally: ViewTally | None = None  # a model's public view: what its selections passed over

    def __len__(self) -> int:
        return len(self.free) + len(self.busy)

    def __iter__(self) -> Iterator[ProviderSession]:
        """Every member, the busy ones first."""
        yield from self.busy
        yield from self.free

    @property
    def longest_context(self) -> float:
        """The longest context a member serves the model with: infinite when one does not say, 0
        without members."""
        if self._contexts[0]:
            return math.inf
        return max(self._contexts, default=0)

    def _place(self, session: ProviderSession) -> None:
        if session not in self.free and session not in self.busy:
            self._contexts[session.context_for(self.names)] += 1
        if session.has_free_slot:
            self.busy.discard(session)
            self.free.put(session, cold=not session.has_loaded(self.names))
        else:
            self.free.discard(session)
            self.busy.add(session)
        if self.tally is not None:
            self.tally.placed(session, session.has_free_slot)

    def count_passed_over(self, book: PassedOver, why_not: Callable[[ProviderSession], str | None]) -> ViewTally:
        """Start counting what this (public) view's selections pass over (fleet/insight.py)."""
        if self.tally is None:
            self.tally = ViewTally(book, why_not, [(s, s in self.free) for s in self])
        return self.tally

    def _drop(self, session: ProviderSession) -> None:
        if session in self.free or session in self.busy:
            self.free.discard(session)
            self.busy.discard(session)
            if self.tally is not None:
                self.tally.left(session)
            context = session.context_for(self.names)
            self._contexts[context] -= 1
            if not self._contexts[context]:
                del self._contexts[context]


class Registry:
    def __init__(self) -> None:
        self.slots = Slots()
        self._sessions: dict[str, ProviderSession] = {}
        self._by_model: dict[str, set[ProviderSession]] = defaultdict(set)
        self._by_account: dict[str, set[ProviderSession]] = defaultdict(set)
        self._by_machine: dict[str, set[ProviderSession]] = defaultdict(set)
        self._views: dict[Hashable, SessionView] = {}
        self.passed_over = PassedOver()  # machine insight: counted by the public views' tallies
        self._public_views: dict[str, list[SessionView]] = defaultdict(list)  # by advertised name
        self._account_views: dict[str, list[SessionView]] = defaultdict(list)
        self._member_of: dict[ProviderSession, set[SessionView]] = {}
        self._stand_ins: set[str] = set()  # other replicas' sessions (fabric/view): neither held nor announced here
        # (last_frame_at when last looked at, order, session): the next session that may have gone silent
        # on top, so ``silent_since`` looks at a session once per heartbeat timeout, not every call
        self._liveness: list[tuple[float, int, ProviderSession]] = []
        self._pushed = itertools.count()
        # told of every change to a session held here (added, removed, disowned, reordered, refiled): the
        # machine insight's meter, and the replica fabric's announcer when there is one
        self.listeners: list[Callable[[ProviderSession], None]] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: ProviderSession) -> None:
        self._sessions[session.id] = session
        for model_id in session.advertised_models:
            self._by_model[model_id].add(session)
        if session.account_id:
            self._by_account[session.account_id].add(session)
        if session.machine_id:
            self._by_machine[session.machine_id].add(session)
        session.listed_in(self)
        if session.id not in self._stand_ins:  # a stand-in is never evicted here: watched, it would stay forever
            self._watch_liveness(session)
        self._recheck(session)
        self._tell(session)

    def add_stand_in(self, session: ProviderSession) -> None:
        """Another replica's session, listed here for routing; its holder announces it."""
        self._stand_ins.add(session.id)
        self.add(session)

    def remove(self, session: ProviderSession) -> bool:
        if self._sessions.pop(session.id, None) is None:
            return False
        session.unlisted()
        for view in self._member_of.pop(session, ()):
            view._drop(session)
        for model_id in session.advertised_models:
            _discard(self._by_model, model_id, session)
        if session.account_id:
            _discard(self._by_account, session.account_id, session)
            self._close_account_views(session.account_id)
        if session.machine_id:
            _discard(self._by_machine, session.machine_id, session)
        self._tell(session)
        self._stand_ins.discard(session.id)
        return True

    def disowned(self, session: ProviderSession, account_id: str | None, machine_id: str | None) -> None:
        """The session's machine was unlinked (``ProviderSession.disown``): it leaves its account's views."""
        if account_id:
            _discard(self._by_account, account_id, session)
        if machine_id:
            _discard(self._by_machine, machine_id, session)
        self._recheck(session)
        if account_id:
            self._close_account_views(account_id)
        self._tell(session)

    def get(self, session_id: str) -> ProviderSession | None:
        return self._sessions.get(session_id)

    def all(self) -> Iterable[ProviderSession]:
        return list(self._sessions.values())

    def held(self, session_id: str) -> ProviderSession | None:
        """The session, when its socket is on this replica (not another replica's stand-in)."""
        return None if session_id in self._stand_ins else self._sessions.get(session_id)

    def held_here(self) -> list[ProviderSession]:
        """The sessions whose socket is on this replica."""
        return [s for s in self._sessions.values() if s.id not in self._stand_ins]

    def serving(self, model_ids: Iterable[str]) -> set[ProviderSession]:
        """Online sessions advertising any of these model ids (an id and its aliases)."""
        found: set[ProviderSession] = set()
        for model_id in model_ids:
            found.update(s for s in self._by_model.get(model_id, ()) if s.online)
        return found

    def owned_by(self, account_id: str) -> set[ProviderSession]:
        return set(self._by_account.get(account_id, ()))

    def for_machine(self, machine_id: str) -> set[ProviderSession]:
        return set(self._by_machine.get(machine_id, ()))

    def silent_since(self, deadline: float) -> list[ProviderSession]:
        """Sessions that sent nothing since ``deadline`` (a stand-in never: its replica's silence removes it).

        A session's ``last_frame_at`` only moves forward, so only the sessions whose last frame, as
        last looked at, is older than ``deadline`` need a look: those that spoke since go back with
        their new time. The eviction loop asks every second; each session is looked at about once
        per ``deadline`` span, whatever the size of the fleet."""
        silent: dict[ProviderSession, None] = {}
        heap = self._liveness
        while heap and heap[0][0] < deadline:
            session = heapq.heappop(heap)[2]
            if self._sessions.get(session.id) is not session or session in silent:
                continue  # removed since (or listed twice, after a removal and an add)
            if session.last_frame_at < deadline:
                silent[session] = None
            else:
                self._watch_liveness(session)
        for session in silent:  # listed until the caller removes it: asked again, it is silent again
            self._watch_liveness(session)
        return list(silent)

    async def evict_silent(self, every: float, timeout: float) -> None:
        """Every ``every`` seconds, close each session that sent nothing for ``timeout`` seconds (1001);
        runs forever."""
        while True:
            await asyncio.sleep(every)
            for session in self.silent_since(time.monotonic() - timeout):
                log.warning("provider %s silent for %.0f s: evicting", session.id, timeout)
                session.close(GOING_AWAY)

    def _watch_liveness(self, session: ProviderSession) -> None:
        heapq.heappush(self._liveness, (session.last_frame_at, next(self._pushed), session))

    # views

    def view(self, key: Hashable) -> SessionView | None:
        return self._views.get(key)

    def open_view(self, key: Hashable, names: tuple[str, ...], account_id: str | None,
                  admits: Callable[[ProviderSession], bool]) -> SessionView:
        """The view under ``key``, made now from the sessions advertising one of ``names`` (of the
        account, unless ``account_id`` is None). With no such session it is empty and not kept:
        a request for a name nobody serves leaves nothing behind."""
        view = SessionView(key, names, account_id, admits)
        if account_id is None:
            pool = {s for name in names for s in self._by_model.get(name, ())}
        else:
            pool = {s for s in self._by_account.get(account_id, ()) if not s.advertised_models.isdisjoint(names)}
        if not pool:
            return view
        self._views[key] = view
        if account_id is None:
            for name in names:
                self._public_views[name].append(view)
        else:
            self._account_views[account_id].append(view)
        for session in pool:
            self._fit(session, view)
        return view

    def reorder(self, session: ProviderSession) -> None:
        """Its active count, decode speed or loaded models changed: it moves within its views, never in or out."""
        for view in self._member_of.get(session, ()):
            view._place(session)
        self._tell(session)

    def refile(self, session: ProviderSession) -> None:
        """Something a view admits it by changed: every view it is in or may join checks it again."""
        self._recheck(session)
        self._tell(session)

    def _tell(self, session: ProviderSession) -> None:
        if session.id in self._stand_ins:
            return
        for listener in self.listeners:
            listener(session)

    def _recheck(self, session: ProviderSession) -> None:
        views = set(self._member_of.get(session, ()))
        for name in session.advertised_models:
            views.update(self._public_views.get(name, ()))
        if session.account_id:
            views.update(self._account_views.get(session.account_id, ()))
        for view in views:
            self._fit(session, view)

    def _fit(self, session: ProviderSession, view: SessionView) -> None:
        if view.admits(session) and (view.account_id is None or view.account_id == session.account_id):
            view._place(session)
            member_of = self._member_of.get(session)
            if member_of is None:
                member_of = self._member_of[session] = set()
            member_of.add(view)
        elif view in self._member_of.get(session, ()):
            view._drop(session)
            self._member_of[session].discard(view)

    def settle_tallies(self) -> None:
        """Bring ``passed_over`` up to date from every public view that counts (a flush of insight)."""
        for view in self._views.values():
            if view.tally is not None and view.tally.unsettled:
                view.tally.flush(self.serving(view.names))

    def close_views(self) -> None:
        """Forget every view (what they admit changed: the catalog did); each opens again on first use."""
        self.settle_tallies()
        for view in self._views.values():
            for session in list(view):
                view._drop(session)
                self._member_of.get(session, set()).discard(view)
        self._views.clear()
        self._public_views.clear()
        self._account_views.clear()

    def _close_account_views(self, account_id: str) -> None:
        if account_id in self._by_account:
            return  # it still has sessions
        for view in self._account_views.pop(account_id, ()):
            self._views.pop(view.key, None)
            for session in list(view):
                view._drop(session)
                self._member_of.get(session, set()).discard(view)


def _discard(index: dict[str, set[ProviderSession]], key: str, session: ProviderSession) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.discard(session)
        if not bucket:
            del index[key]
