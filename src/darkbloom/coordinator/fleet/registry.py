"""Live provider sessions, indexed by model, by owner account and by machine; and their slots."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Iterable

from darkbloom.coordinator.fleet.session import ProviderSession
from darkbloom.coordinator.fleet.slots import Slots

log = logging.getLogger("darkbloom.registry")


class Registry:
    def __init__(self) -> None:
        self.slots = Slots()
        self._sessions: dict[str, ProviderSession] = {}
        self._by_model: dict[str, set[ProviderSession]] = defaultdict(set)
        self._by_account: dict[str, set[ProviderSession]] = defaultdict(set)
        self._by_machine: dict[str, set[ProviderSession]] = defaultdict(set)

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

    def remove(self, session: ProviderSession) -> bool:
        if self._sessions.pop(session.id, None) is None:
            return False
        session.online = False
        for model_id in session.advertised_models:
            _discard(self._by_model, model_id, session)
        if session.account_id:
            _discard(self._by_account, session.account_id, session)
        if session.machine_id:
            _discard(self._by_machine, session.machine_id, session)
        return True

    def disown(self, session: ProviderSession) -> None:
        """The session's machine was unlinked: it is no longer anyone's "own" machine."""
        if session.account_id:
            _discard(self._by_account, session.account_id, session)
        if session.machine_id:
            _discard(self._by_machine, session.machine_id, session)
        session.account_id = None
        session.machine_id = None

    def get(self, session_id: str) -> ProviderSession | None:
        return self._sessions.get(session_id)

    def all(self) -> Iterable[ProviderSession]:
        return list(self._sessions.values())

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
        return [s for s in self._sessions.values() if s.last_frame_at < deadline]


def _discard(index: dict[str, set[ProviderSession]], key: str, session: ProviderSession) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.discard(session)
        if not bucket:
            del index[key]
