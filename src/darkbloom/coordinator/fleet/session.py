"""One connected provider as the coordinator sees it (a fresh ``prov_`` id per connection)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from nacl.public import PublicKey

from darkbloom.wire.protocol import Register

if TYPE_CHECKING:
    from darkbloom.coordinator.fleet.pending import PendingRequest
    from darkbloom.coordinator.fleet.slots import Slot

# what the registry's views of free sessions depend on: setting one of these calls the session's
# ``_watch`` (the registry's, while the session is listed), whoever sets it
WATCHED = frozenset({"_active", "decode_tps", "online", "draining", "untrusted_reason", "trust_level",
                     "runtime_verified", "public_key", "account_id"})


@dataclass(eq=False)
class ProviderSession:
    """One connected provider (a fresh ``prov_`` id per connection). With replicas, the sessions other
    replicas hold are listed too, as ``fabric.remote_session.RemoteSession`` stand-ins (``remote``)."""

    remote: ClassVar[bool] = False
    id: str
    account_id: str | None           # stamped from the device token at registration; None = unowned
    machine_id: str | None
    registration: Register
    public_key: PublicKey | None
    trust_level: str = "none"
    connected_at: float = field(default_factory=time.monotonic)
    last_frame_at: float = field(default_factory=time.monotonic)
    _active: int = 0                  # claimed slots; only fleet.slots changes it
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
    _watch: Callable[["ProviderSession", str], None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.advertised_models = frozenset(m.id for m in self.registration.models)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in WATCHED:
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch(self, name)

    @property
    def max_concurrency(self) -> int:
        return self.registration.max_concurrency

    @property
    def private_only(self) -> bool:
        return self.registration.private_only

    @property
    def active(self) -> int:
        return self._active

    @property
    def has_free_slot(self) -> bool:
        return self.active < self.max_concurrency

    def send(self, frame_json: str) -> None:
        """Queue a frame for this session's single writer task (never blocks, never interleaves)."""
        self.outbox.put_nowait(frame_json)

    def send_request(self, pending: "PendingRequest", frame_json: str) -> None:
        """Send the sealed ``inference_request`` of an attempt on one of this session's slots."""
        self.send(frame_json)

    async def confirm(self, slot: "Slot") -> bool:
        """Whether a slot claimed here is really this session's (always, for a session of this process)."""
        return True

    def close(self, code: int = 1000) -> None:
        """Ask the writer to close the socket once the frames queued before now are sent."""
        if self.close_code is None:
            self.close_code = code
            self.outbox.put_nowait(None)
