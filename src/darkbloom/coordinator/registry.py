"""Live provider sessions, indexed by model and by owner account."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from nacl.public import PublicKey

from darkbloom.protocol import Register

if TYPE_CHECKING:
    from darkbloom.coordinator.relay import PendingRequest

log = logging.getLogger("darkbloom.registry")


@dataclass(eq=False)
class ProviderSession:
    """One connected provider (a fresh ``prov_`` id per connection)."""

    id: str
    account_id: str | None           # stamped from the device token at registration; None = unowned
    machine_id: str | None
    registration: Register
    public_key: PublicKey | None
    trust_level: str = "none"
    connected_at: float = field(default_factory=time.monotonic)
    last_frame_at: float = field(default_factory=time.monotonic)
    active: int = 0
    online: bool = False              # listed as routable only after registration completes
    outbox: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    pending: dict[str, "PendingRequest"] = field(default_factory=dict)
    advertised_models: frozenset[str] = frozenset()
    close_code: int | None = None
    untrusted_reason: str | None = None      # set once the session fails a check; never routable again
    runtime_verified: bool = False           # runtime hash in the coordinator's allow-list
    challenge_passed_at: float | None = None  # monotonic time of the last passed attestation challenge
    decode_tps: float = 0.0                  # measured completion tokens per second (EWMA)
    draining: bool = False                   # finishing in-flight work before it closes; takes nothing new
    machine_seen_at: float = 0.0

    def __post_init__(self) -> None:
        self.advertised_models = frozenset(m.id for m in self.registration.models)

    @property
    def max_concurrency(self) -> int:
        return self.registration.max_concurrency

    @property
    def private_only(self) -> bool:
        return self.registration.private_only

    @property
    def has_free_slot(self) -> bool:
        return self.active < self.max_concurrency

    def send(self, frame_json: str) -> None:
        """Queue a frame for this session's single writer task (never blocks, never interleaves)."""
        self.outbox.put_nowait(frame_json)

    def close(self, code: int = 1000) -> None:
        """Ask the writer to close the socket once the frames queued before now are sent."""
        if self.close_code is None:
            self.close_code = code
            self.outbox.put_nowait(None)


class Registry:
    def __init__(self) -> None:
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
